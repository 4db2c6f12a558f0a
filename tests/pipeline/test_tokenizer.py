"""Tokenizer training (tools/train_tokenizer.py) on a slice of tiny shakespeare, and the wrapper."""

import pathlib
import subprocess
import sys

import pytest

from model.data.pipeline import split_heldout
from model.data.tokenizer import IdsOnlyTokenizer, SentencePieceTokenizer, TokenizerError, load_tokenizer
from tools.train_tokenizer import main, train_tokenizer

# ../shared/data beside the project root (every developer machine and CI; not in a user's clone).
SHAKESPEARE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
REPO = pathlib.Path(__file__).resolve().parents[2]
# A held-out tail made of a word and a letter that never occur in the training slice: if the
# trainer saw the held-out split, character_coverage=1.0 would force "Ж" into the vocabulary and
# BPE would merge the many repeats of "zqxj".
HELDOUT_TAIL = "zqxj Жzqxj zqxjЖ zqxj\n" * 60


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  if not SHAKESPEARE.is_file():
    pytest.skip(f"{SHAKESPEARE} not present (it lives outside the project)")
  text = SHAKESPEARE.read_bytes()[:40_000].decode("utf-8")
  text = text[:text.rindex("\n") + 1] + HELDOUT_TAIL
  path = tmp_path_factory.mktemp("tok") / "slice.txt"
  path.write_text(text, encoding="utf-8")
  train, heldout = split_heldout(text, 0.1)
  assert HELDOUT_TAIL in heldout and "Ж" not in train and "zqxj" not in train
  return path, train, heldout


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
  path, _, _ = corpus
  prefix = str(tmp_path_factory.mktemp("tok") / "sp")
  stats = train_tokenizer(str(path), prefix, 400, model_type="bpe", num_threads=1)
  return SentencePieceTokenizer(stats["model_path"]), stats


def test_training_stats_and_specials(trained, corpus):
  tok, stats = trained
  _, train, heldout = corpus
  assert stats["train_bytes"] == len(train.encode()) and stats["heldout_bytes"] == len(heldout.encode())
  assert tok.vocab_size == 400
  assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
  assert tok.id_to_piece(4) == "\n" and tok.encode("\n\n") == [4, 4]
  vocab = pathlib.Path(stats["model_path"]).with_suffix(".vocab").read_text(encoding="utf-8")
  lines = vocab.split("\n")
  assert len(lines) == 401 and lines[-1] == "" and lines[4] == "\\n\t0.0"


def test_never_trained_on_heldout(trained):
  tok, _ = trained
  pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
  assert "Ж" not in pieces and not any("zqxj" in p for p in pieces)
  # Ж still round-trips through byte fallback (2 UTF-8 bytes -> 2 byte pieces), never <unk>.
  ids = tok.encode("Ж")
  assert [tok.id_to_piece(i) for i in ids] == ["<0xD0>", "<0x96>"]


@pytest.mark.parametrize("text", [
    None,  # the held-out split itself
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "  leading and  double  spaces, tabs\tand trailing  \n",
    "Unicode: héllo wörld, 日本語, emoji 🙂, combining é, NUL-free \u2028 line sep",
    "",
])
def test_round_trip(trained, corpus, text):
  tok, _ = trained
  text = corpus[2] if text is None else text
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids) and tok.unk_id not in ids
  assert tok.decode(ids) == text
  framed = tok.encode(text, add_bos=True, add_eos=True)
  assert framed == [tok.bos_id] + ids + [tok.eos_id] and tok.decode(framed) == text
  assert tok.encode_batch([text, "ab"]) == [ids, tok.encode("ab")]


def test_compresses_shakespeare(trained, corpus):
  tok, _ = trained
  train = corpus[1]
  # 400 pieces = 261 fixed (specials, "\n", bytes) + ~60 characters + ~80 merges: real merges
  # must make the text shorter than one token per byte.
  assert len(tok.encode(train)) < 0.8 * len(train.encode())


def test_unigram_round_trip(corpus, tmp_path):
  stats = train_tokenizer(str(corpus[0]), str(tmp_path / "uni"), 400, model_type="unigram",
                          num_threads=1)
  tok = SentencePieceTokenizer(stats["model_path"])
  assert tok.decode(tok.encode(corpus[2])) == corpus[2]


def test_cli_help_and_errors(tmp_path, capsys):
  assert main(["--help"]) == 0
  assert "model_prefix=PATH" in capsys.readouterr().out
  cases = [
      (["input=x"], "missing required argument(s): model_prefix, vocab_size"),
      (["input=x", "model_prefix=y", "vocab_size=ten"], "error: vocab_size='ten': expected an integer"),
      (["input=x", "model_prefix=y", "vocab_size=10", "heldout_fraction=x"], "heldout_fraction='x': expected a number"),
      (["input=x", "model_prefix=y", "vocab_size=10", "colour=red"], "unknown argument 'colour'"),
      (["input=x", "model_prefix=y", "vocab_size=10", "model_type=wordpiece"], "model_type"),
      (["input=x", "model_prefix=y", "vocab_size=10", "heldout_fraction=1"], "heldout_fraction"),
      (["vocab_size"], "key=value"),
  ]
  for argv, needle in cases:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("content,needle", [
    (None, "input file not found"),
    (b"", "input file is empty"),
    (b"  \n\n\t\n", "input file is empty"),
    (b"good line\nbad \xff line\n", ":2: not valid UTF-8"),
    (b"a single line without newline", "training split"),
])
def test_cli_bad_input(tmp_path, capsys, content, needle):
  path = tmp_path / "in.txt"
  if content is not None:
    path.write_bytes(content)
  assert main([f"input={path}", f"model_prefix={tmp_path / 'm'}", "vocab_size=300"]) == 2
  err = capsys.readouterr().err
  assert needle in err and str(path) in err
  assert not (tmp_path / "m.model").exists()


def test_cli_vocab_too_small_says_minimum(corpus, tmp_path, capsys):
  assert main([f"input={corpus[0]}", f"model_prefix={tmp_path / 'm'}", "vocab_size=50"]) == 2
  assert "this data needs vocab_size >=" in capsys.readouterr().err


def test_cli_subprocess_trains(corpus, tmp_path):
  r = subprocess.run([sys.executable, "-m", "tools.train_tokenizer", f"input={corpus[0]}",
                      f"model_prefix={tmp_path / 'cli'}", "vocab_size=350"],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "bytes/token" in r.stdout
  assert SentencePieceTokenizer(tmp_path / "cli.model").vocab_size == 350


def test_existing_output_needs_overwrite(corpus, tmp_path, capsys, monkeypatch):
  """An existing PATH.model / PATH.vocab is refused before the input is read, unless overwrite=true."""
  import tools.train_tokenizer as tt
  prefix = tmp_path / "m"
  (tmp_path / "m.vocab").write_text("keep me\n")

  def no_read(*a, **k):
    raise AssertionError("the input was read before the existing output was refused")
  monkeypatch.setattr(tt, "read_text_file", no_read)
  assert main([f"input={corpus[0]}", f"model_prefix={prefix}", "vocab_size=350"]) == 2
  assert capsys.readouterr().err == (f"error: model_prefix={str(prefix)!r}: {str(prefix) + '.vocab'!r} already "
                                     f"exists; pass overwrite=true to replace it\n")
  assert main([f"input={corpus[0]}", f"model_prefix={prefix}", "vocab_size=350", "overwrite=maybe"]) == 2
  assert "overwrite must be true or false, got 'maybe'" in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.vocab"] and (tmp_path / "m.vocab").read_text() == "keep me\n"
  monkeypatch.undo()
  assert main([f"input={corpus[0]}", f"model_prefix={prefix}", "vocab_size=350", "overwrite=true"]) == 0
  assert SentencePieceTokenizer(tmp_path / "m.model").vocab_size == 350
  vocab = (tmp_path / "m.vocab").read_text().splitlines()
  assert len(vocab) == 350 and vocab[0].startswith("<pad>\t")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.model", "m.vocab"]  # no temporary left behind
  capsys.readouterr()
  assert main([f"input={corpus[0]}", f"model_prefix={prefix}", "vocab_size=350"]) == 2  # both exist now
  assert "'.model' and" not in (err := capsys.readouterr().err) and "m.model' and '" in err and "replace them" in err


def test_load_errors_name_the_path(tmp_path):
  with pytest.raises(TokenizerError, match="not found: .*missing.model"):
    SentencePieceTokenizer(tmp_path / "missing.model")
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"this is not a protobuf \x00\xff")
  with pytest.raises(TokenizerError, match="not a valid sentencepiece model file: .*bad.model"):
    SentencePieceTokenizer(bad)
  empty = tmp_path / "empty.model"
  empty.write_bytes(b"")
  with pytest.raises(TokenizerError, match="empty.*empty.model"):
    SentencePieceTokenizer(empty)
  with pytest.raises(TokenizerError, match="not a file"):
    SentencePieceTokenizer(tmp_path)


def test_decode_rejects_out_of_range(trained):
  tok, _ = trained
  with pytest.raises(TokenizerError, match="out of range"):
    tok.decode([5, tok.vocab_size])


def test_ids_only_mode():
  tok = load_tokenizer(None, vocab_size=50, bos_id=1, eos_id=2)
  assert isinstance(tok, IdsOnlyTokenizer) and tok.ids_only
  assert tok.encode(" 5 17,3\n9 ") == [5, 17, 3, 9]
  assert tok.encode("5", add_bos=True, add_eos=True) == [1, 5, 2]
  assert tok.decode([5, 17, 3]) == "5 17 3"
  with pytest.raises(TokenizerError, match="expected integer token ids.*'x'"):
    tok.encode("5 x")
  with pytest.raises(TokenizerError, match="out of range"):
    tok.encode("50")
  with pytest.raises(TokenizerError, match="needs vocab_size"):
    load_tokenizer("")
  with pytest.raises(TokenizerError, match="bos_id=60"):
    IdsOnlyTokenizer(50, bos_id=60)
  with pytest.raises(TokenizerError, match="no bos_id"):
    IdsOnlyTokenizer(50).encode("1", add_bos=True)


def test_cli_input_directory_says_directory(tmp_path, capsys):
  """input=<a directory> says so (it used to say "input file not found")."""
  assert main([f"input={tmp_path}", f"model_prefix={tmp_path / 'm'}", "vocab_size=300"]) == 2
  assert capsys.readouterr().err == f"error: input={str(tmp_path)!r} is a directory; expected a UTF-8 text file\n"
  assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_get_the_umask_mode(corpus, tmp_path, umask):
  """.model / .vocab get 0o666 less the umask, as a plain open() gives (they were 0o600: mkstemp)."""
  import os
  old = os.umask(umask)
  try:
    stats = train_tokenizer(str(corpus[0]), str(tmp_path / "m"), 350, num_threads=1)
  finally:
    os.umask(old)
  for path in (stats["model_path"], str(tmp_path / "m.vocab")):
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask, (path, oct(os.stat(path).st_mode))
