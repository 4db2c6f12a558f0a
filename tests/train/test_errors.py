"""tools.train's clear errors: missing data, an empty corpus, a mismatched resume config, bad keys,
and the command line (one line on stderr, exit status 2, no traceback, nothing written)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from model.training import steps as train_lib
from model.config import ConfigError
from model.training.steps import TrainError
from tests.train.helpers import counting_documents, tiny_config, write_ids_corpus
from model.training.trainer import check_output_dir, train
from tools.train import main


@pytest.fixture
def corpus(tmp_path):
  path = tmp_path / "count.ids"
  write_ids_corpus(path, counting_documents(40, seed=1))
  return path


def test_missing_train_data(tmp_path):
  with pytest.raises(TrainError, match=r"train_data is required: pass train_data=FILE"):
    train(tiny_config("", tmp_path / "out"), progress=False)
  with pytest.raises(TrainError, match=r"train_data='.*nope.ids' does not exist"):
    train(tiny_config(tmp_path / "nope.ids", tmp_path / "out"), progress=False)
  assert not (tmp_path / "out").exists()  # nothing written before the data is known to be good


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_corpus(tmp_path, content):
  path = tmp_path / "empty.ids"
  path.write_text(content)
  with pytest.raises(TrainError, match=r"train_data='.*empty.ids' is empty: it holds no documents"):
    train(tiny_config(path, tmp_path / "out"), progress=False)
  assert not (tmp_path / "out").exists()


def test_a_document_longer_than_a_row_with_split_long_none_names_split_long(tmp_path):
  """The packer's message named its own argument (`split='long'`), a key kda-train does not have."""
  path = tmp_path / "long.ids"
  write_ids_corpus(path, [np.arange(3, 53)] * 30)   # ids < the tiny vocabulary (64)
  with pytest.raises(TrainError) as e:
    train(tiny_config(path, tmp_path / "out", "seq_len=16", "split_long=none"), progress=False)
  assert str(e.value) == (f"train_data={str(path)!r}: a document of 52 tokens (after framing) is longer than "
                          f"seq_len=16, and split_long='none' keeps documents whole; pass split_long=long or "
                          f"split_long=fill to cut long documents, or a larger seq_len")
  assert not (tmp_path / "out").exists()


def test_single_line_corpus_has_no_training_split(tmp_path):
  path = tmp_path / "one.ids"
  path.write_text("5 6 7 8\n")
  with pytest.raises(TrainError, match=r"training split of train_data=.* is empty"):
    train(tiny_config(path, tmp_path / "out"), progress=False)


def test_output_dir_and_tokenizer_keys(corpus, tmp_path):
  with pytest.raises(TrainError, match=r"output_dir is required"):
    train(tiny_config(corpus, ""), progress=False)
  with pytest.raises(TrainError, match=r"tokenizer_path is required for train_data_format='text'"):
    train(tiny_config(corpus, tmp_path / "o", "train_data_format=text"), progress=False)
  with pytest.raises(TrainError, match=r"warmup_steps=10 is invalid: expected fewer than steps=5"):
    train(tiny_config(corpus, tmp_path / "o", "steps=5", "warmup_steps=10"), progress=False)
  # The held-out side is the last line (a blank one here): no held-out tokens to evaluate on.
  blank_tail = tmp_path / "blank_tail.ids"
  blank_tail.write_text("5 6 7\n8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29\n   \n")
  with pytest.raises(TrainError, match=r"held-out split .* holds no tokens; raise heldout_fraction or pass eval_every=0"):
    train(tiny_config(blank_tail, tmp_path / "o", "eval_every=5", "heldout_fraction=0.01", "steps=3"),
          progress=False)


def test_unrelated_non_empty_output_dir_is_refused(corpus, tmp_path):
  """output_dir may be new, empty or a run directory of tools.train; any other non-empty directory is
  refused before anything is written, unless overwrite=true (which deletes nothing)."""
  out = tmp_path / "mine"
  out.mkdir()
  (out / "notes.txt").write_text("mine\n")
  (out / "data").mkdir()
  with pytest.raises(TrainError) as e:
    train(tiny_config(corpus, out, "steps=3"), progress=False)
  assert str(e.value) == (
      f"output_dir={str(out)!r} is not empty and is not a run directory of tools.train (no checkpoints/ or "
      f"metrics.jsonl; it holds data, notes.txt); choose a new or empty directory, or pass overwrite=true to "
      f"write the run into it (nothing in it is deleted)")
  assert sorted(p.name for p in out.iterdir()) == ["data", "notes.txt"]
  # Accepted (no train step compiled here: the check itself; test_train.py's SIGTERM test runs
  # train() into such a directory with overwrite=true and finds notes.txt kept):
  check_output_dir(out, str(out), overwrite=True)                  # asked for
  check_output_dir(tmp_path / "new", "new", overwrite=False)       # does not exist yet
  (tmp_path / "empty").mkdir()
  check_output_dir(tmp_path / "empty", "empty", overwrite=False)   # empty
  for marker in ("checkpoints", "metrics.jsonl"):                   # a run of this tool (resumable or finished)
    run = tmp_path / f"run-{marker}"
    run.mkdir()
    (run / "notes.txt").write_text("")
    (run / marker).mkdir() if marker == "checkpoints" else (run / marker).write_text("")
    check_output_dir(run, str(run), overwrite=False)


def test_resume_with_a_different_config_is_refused(corpus, tmp_path):
  # The config is checked against the checkpoint's metadata before any array is built or read,
  # so a stand-in state is enough here (test_train.py resumes real train states).
  from model.data.pipeline import BatchIterator, pack_documents
  from model.training.trainer import CHECKPOINT_SUBDIR, _meta, _tokenizer

  out = tmp_path / "run"
  cfg = tiny_config(corpus, out, "steps=6")
  state = {"step": np.zeros((), np.int32)}
  ckpt = train_lib.TrainCheckpointer(out / CHECKPOINT_SUBDIR, 2)
  it = BatchIterator(pack_documents([[1, 5, 6, 2]], 32), 4, 0)
  ckpt.save(0, state, it.state, _meta(cfg, _tokenizer(cfg)))
  ckpt.close()

  with pytest.raises(TrainError, match=r"cannot resume from .*checkpoints: the config does not match the "
                                       r"checkpoint \(hidden_size: checkpoint=32, now=48; learning_rate: "
                                       r"checkpoint=0.003, now=0.001\)"):
    train(tiny_config(corpus, out, "steps=6", "hidden_size=48", "learning_rate=1e-3"), progress=False)
  with pytest.raises(TrainError, match=r"steps: checkpoint=6, now=8"):
    train(tiny_config(corpus, out, "steps=8"), progress=False)
  other = tmp_path / "other.ids"
  write_ids_corpus(other, counting_documents(40, seed=2))
  with pytest.raises(TrainError, match=r"train_data file content differs from the one the checkpoint was trained on"):
    train(tiny_config(other, out, "steps=6"), progress=False)
  with pytest.raises(TrainError, match=r"holds train checkpoints up to step 0; pass resume=true"):
    train(tiny_config(corpus, out, "steps=6", "resume=false"), progress=False)


def test_resume_mismatches_ignores_operational_keys():
  saved = {"hidden_size": 32, "eval_every": 10, "kda_layers": [1, 3], "output_dir": "/a"}
  now = {"hidden_size": 32, "eval_every": 99, "kda_layers": (1, 3), "output_dir": "/b", "new_key": 1}
  assert train_lib.resume_mismatches(saved, now) == []
  assert train_lib.resume_mismatches(saved, {**now, "kda_layers": [1, 2]}) == [
      "kda_layers: checkpoint=[1, 3], now=[1, 2]"]


def test_command_line_error_is_one_line_without_traceback(tmp_path):
  out = tmp_path / "o"
  proc = subprocess.run([sys.executable, "-m", "tools.train", "tiny", f"train_data={tmp_path / 'missing.txt'}",
                         "train_data_format=ids", f"output_dir={out}"], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2
  lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
  assert lines == [f"error: train_data={str(tmp_path / 'missing.txt')!r} does not exist"], proc.stderr
  assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("below", ["sub", "a/b/c"])
def test_output_dir_under_a_file_names_output_dir(corpus, tmp_path, capsys, below):
  """A file where a directory of output_dir's path should be: the error was the bare errno line
  ("[Errno 20] Not a directory: ..."), given after the data was read; now it names output_dir and the
  file, before anything is read or written."""
  (tmp_path / "afile").write_text("mine\n")
  given = str(tmp_path / "afile" / below)
  with pytest.raises(TrainError) as e:
    train(tiny_config(corpus, given), progress=False)
  assert str(e.value) == (f"output_dir={given!r}: {str(tmp_path / 'afile')!r} is a file, not a directory, so the "
                          f"run directory cannot be made under it")
  assert main(["tiny", f"train_data={corpus}", "train_data_format=ids", f"output_dir={given}"]) == 2
  assert capsys.readouterr().err == f"error: {e.value}\n"
  assert (tmp_path / "afile").read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["afile",
                                                                                                        "count.ids"]


def test_output_dir_that_cannot_be_created_names_output_dir(corpus, tmp_path, monkeypatch):
  """Any other failure to create output_dir (here a PermissionError, as a read-only parent gives) names it."""
  out = tmp_path / "ro" / "run"
  real = pathlib.Path.mkdir

  def refuse(self, *args, **kwargs):
    if self == out:
      raise PermissionError(13, "Permission denied", str(self))
    return real(self, *args, **kwargs)
  monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
  with pytest.raises(TrainError) as e:
    train(tiny_config(corpus, out), progress=False)
  assert str(e.value) == f"output_dir={str(out)!r}: cannot create it (Permission denied)"
  assert not out.exists()


def test_a_missing_or_invalid_tokenizer_names_tokenizer_path(tmp_path, capsys):
  text = tmp_path / "c.txt"
  text.write_text("To be, or not to be.\n\nThat is the question.\n\nWhether 'tis nobler.\n")
  missing = str(tmp_path / "nope.model")
  with pytest.raises(TrainError) as e:
    train(tiny_config(text, tmp_path / "o", "train_data_format=text", f"tokenizer_path={missing}"), progress=False)
  assert str(e.value) == (f"tokenizer_path={missing!r} does not exist: expected a sentencepiece .model file "
                          f"(tools.train_tokenizer writes one), or a directory with tiktoken.model and "
                          f"tokenizer_config.json")
  assert main(["tiny", f"train_data={text}", f"tokenizer_path={missing}", f"output_dir={tmp_path / 'o'}"]) == 2
  assert capsys.readouterr().err == f"error: {e.value}\n"
  (tmp_path / "tokdir").mkdir()
  with pytest.raises(TrainError, match=r"^tokenizer_path='.*tokdir': the tokenizer directory .* has no tiktoken.model"):
    train(tiny_config(text, tmp_path / "o", f"tokenizer_path={tmp_path / 'tokdir'}"), progress=False)
  with pytest.raises(TrainError, match=r"^tokenizer_path='.*c.txt': not a valid sentencepiece model file"):
    train(tiny_config(text, tmp_path / "o", f"tokenizer_path={text}"), progress=False)
  assert not (tmp_path / "o").exists()


def test_impossible_mesh_is_refused_on_one_device(corpus, tmp_path):
  import jax
  n = jax.device_count()
  with pytest.raises(ConfigError, match=rf"ici_data_parallelism={n + 1}.* but there are {n} devices"):
    train(tiny_config(corpus, tmp_path / "o", f"ici_data_parallelism={n + 1}"), progress=False)
  assert not (tmp_path / "o").exists()


def test_unknown_model_config_lists_the_available_ones(capsys):
  assert main(["nosuchconfig"]) == 2
  err = capsys.readouterr().err
  assert "did you mean []" not in err and "available: " in err and "tiny" in err, err


def test_bad_key_and_help(capsys):
  assert main(["tiny", "learning_rat=1"]) == 2
  assert "unknown config key 'learning_rat'; did you mean learning_rate" in capsys.readouterr().err
  assert main(["--help"]) == 0
  text = capsys.readouterr().out
  for key in ("train_data", "checkpoint_every", "stop_at_step", "export_dtype", "warmup_steps"):
    assert f"{key} = " in text


def test_tokenizer_that_does_not_fit_the_config(tmp_path):
  from tools import demo
  tok = demo.ASSETS / "tokenizer.model"  # 1024 pieces, pad 0, bos 2, eos 3
  text = tmp_path / "c.txt"
  text.write_text("To be, or not to be.\n\nThat is the question.\n\nWhether 'tis nobler.\n")
  base = ("train_data_format=text", f"tokenizer_path={tok}")
  # Every mismatch in one message, with one `pass ...` that fixes them all.
  with pytest.raises(TrainError) as e:
    train(tiny_config(text, tmp_path / "o", *base), progress=False)
  assert str(e.value) == (
      f"the tokenizer tokenizer_path={str(tok)!r} does not fit the model config: it has 1024 tokens but vocab_size=64; its bos id "
      f"is 2 but bos_token_id=1; its eos id is 3 but eos_token_id=2; pass vocab_size=1024 bos_token_id=2 "
      f"eos_token_id=3 (vocab_size may be larger)")
  with pytest.raises(TrainError, match=r"its bos id is 2 but bos_token_id=1; its eos id is 3 but eos_token_id=2; "
                                       r"pass bos_token_id=2 eos_token_id=3$"):
    train(tiny_config(text, tmp_path / "o", *base, "vocab_size=1024"), progress=False)
  assert not (tmp_path / "o").exists()


def test_train_tokenizer_output_with_the_tiny_config(tmp_path):
  """A tokenizer from tools.train_tokenizer (pad 0, unk 1, bos 2, eos 3) with the tiny config (bos 1, eos 2):
  the one error names every key to change, and those overrides alone make the pair fit."""
  from tools import train_tokenizer
  from model.training.trainer import _tokenizer
  text = tmp_path / "c.txt"
  text.write_text("".join(f"line {i} of a small corpus, with words to merge.\n" for i in range(200)))
  assert train_tokenizer.main([f"input={text}", f"model_prefix={tmp_path / 'tok'}", "vocab_size=300"]) == 0
  tok = tmp_path / "tok.model"
  keys = ("train_data_format=text", f"tokenizer_path={tok}")
  with pytest.raises(TrainError) as e:
    train(tiny_config(text, tmp_path / "o", *keys), progress=False)
  msg = str(e.value)
  assert msg.endswith("; pass vocab_size=300 bos_token_id=2 eos_token_id=3 (vocab_size may be larger)"), msg
  assert "its bos id is 2 but bos_token_id=1" in msg and "its eos id is 3 but eos_token_id=2" in msg
  assert "pad" not in msg  # pad 0 agrees
  fixed = _tokenizer(tiny_config(text, tmp_path / "o", *keys, *msg.split("; pass ")[1].split(" (")[0].split()))
  assert (fixed.vocab_size, fixed.bos_id, fixed.eos_id, fixed.pad_id) == (300, 2, 3, 0)
  assert not (tmp_path / "o").exists()


def test_a_damaged_checkpoint_is_named_not_a_traceback(corpus, tmp_path):
  """A step directory that is no kda-train checkpoint (junk in it), or one whose train state was
  removed: a TrainError naming the step directory and the missing item, not a KeyError from Orbax."""
  import shutil

  from model.data.pipeline import BatchIterator, pack_documents
  from model.training.trainer import CHECKPOINT_SUBDIR, _meta, _tokenizer

  junk = tmp_path / "junk"
  (junk / CHECKPOINT_SUBDIR / "3").mkdir(parents=True)
  (junk / CHECKPOINT_SUBDIR / "3" / "junk").write_text("x")
  with pytest.raises(TrainError, match=r"checkpoint .*checkpoints/3 is incomplete or not a kda-train checkpoint "
                                       r"\('meta' cannot be read"):
    train(tiny_config(corpus, junk), progress=False)

  out = tmp_path / "run"
  cfg = tiny_config(corpus, out)
  state = {"step": np.zeros((), np.int32)}
  ckpt = train_lib.TrainCheckpointer(out / CHECKPOINT_SUBDIR, 2)
  ckpt.save(0, state, BatchIterator(pack_documents([[1, 5, 6, 2]], 32), 4, 0).state, _meta(cfg, _tokenizer(cfg)))
  shutil.rmtree(out / CHECKPOINT_SUBDIR / "0" / train_lib.STATE_ITEM)
  with pytest.raises(TrainError, match=r"checkpoints/0 is incomplete or not a kda-train checkpoint \('state' cannot"):
    ckpt.restore(0, state)
  ckpt.close()
