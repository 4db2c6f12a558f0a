"""The Kimi tokenizer (model/data/tokenizer_kimi.py) on the fixture tests/fixtures/kimi_tokenizer/: the
same ids as the `tiktoken` library's own Encoding (built here from the file, with the fixture script's
copy of Kimi's pattern), decode round trips, streaming across characters split over tokens, the
loader's choice and its errors."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

import pytest
import tiktoken
from hypothesis import given
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe

from model.data.tokenizer import (SentencePieceTokenizer, TokenizerError, check_tokenizer_fits, load_tokenizer)
from model.data.tokenizer_kimi import MAX_RUN_CHARS, KimiTokenizer, read_tiktoken_ranks
from model.server.text import TextStream

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "kimi_tokenizer"
DEMO_SP = REPO / "kda_plugin" / "assets" / "demo" / "tokenizer.model"
BASE = 2048


def _fixture_script():
  spec = importlib.util.spec_from_file_location("make_kimi_tokenizer", REPO / "tests" / "fixtures" /
                                                "make_kimi_tokenizer.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
  return KimiTokenizer(FIXTURE)


@pytest.fixture(scope="module")
def ref() -> tiktoken.Encoding:
  """tiktoken's own Encoding of the fixture: its loader (no cache) and the fixture script's pattern."""
  mp = pytest.MonkeyPatch()
  mp.setenv("TIKTOKEN_CACHE_DIR", "")   # tiktoken caches a file by its path name otherwise
  try:
    ranks = load_tiktoken_bpe(str(FIXTURE / "tiktoken.model"))
  finally:
    mp.undo()
  config = json.loads((FIXTURE / "tokenizer_config.json").read_text())
  named = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
  specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(BASE, BASE + 256)}
  return tiktoken.Encoding("ref", pat_str=_fixture_script().KIMI_PATTERN, mergeable_ranks=ranks,
                           special_tokens=specials)


TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.",
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
    "中英 mixed 文本 with numbers 1234567 and 3.14159, 第12章",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇨🇳🇫🇷 龘 𠀋",
    "   leading\t\ttabs\n\n\n   trailing   \r\n\r\n",
    "don't we'll THEY'RE I'M you'd O'Neil",
    "<|im_end|><|im_user|>[BOS] literal special tokens are text",
    "Ünïcödé façade — “quotes” … ½ ² ∑ Ω",
    "",
    " ",
    "\n",
]


def test_ranks_match_tiktoken_loader(ref):
  ours = read_tiktoken_ranks(FIXTURE / "tiktoken.model")
  assert ours == ref._mergeable_ranks and len(ours) == BASE


def test_surface(tok):
  assert (tok.vocab_size, tok.num_base_tokens) == (BASE + 256, BASE)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (BASE, BASE + 1, BASE + 255, BASE + 254)
  assert tok.special_tokens["<|im_end|>"] == BASE + 2 and tok.special_tokens["<|im_middle|>"] == BASE + 17
  assert tok.special_tokens["<|reserved_token_2053|>"] == BASE + 5
  assert tok.stop_ids == {BASE + 1, BASE + 2}        # [EOS], <|im_end|> (also generation_config's eos)
  assert not tok.ids_only and tok.chat_template is not None
  assert tok.encode("hi", add_bos=True, add_eos=True)[::len(tok.encode("hi")) + 1] == [BASE, BASE + 1]
  assert tok.id_to_piece(BASE + 2) == "<|im_end|>" and tok.is_special(BASE) and not tok.is_special(BASE - 1)


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_tiktoken(tok, ref, text):
  ids = tok.encode(text)
  assert ids == ref.encode_ordinary(text) == ref.encode(text, disallowed_special=())
  assert tok.decode(ids) == text


@given(st.text(max_size=300))
def test_same_ids_as_tiktoken_any_text(tok, ref, text):
  ids = tok.encode(text)
  assert ids == ref.encode_ordinary(text)
  assert all(0 <= i < BASE for i in ids)
  assert tok.decode(ids) == text


@given(st.lists(st.sampled_from(["<|im_end|>", "<|im_system|>", "[BOS]", "[EOS]", "<|im_middle|>", "<|", "|>",
                                 "a", " ", "中", "\n"]), max_size=40).map("".join))
def test_special_strings_are_text(tok, ref, text):
  ids = tok.encode(text)
  assert all(i < BASE for i in ids) and ids == ref.encode_ordinary(text) and tok.decode(ids) == text
  # Only with allow_special (text trusted to be a rendered prompt) do they become control ids.
  assert tok.encode(text, allow_special=True) == ref.encode(text, allowed_special="all")


def test_batch_and_long_runs(tok, ref):
  assert tok.encode_batch(TEXTS, add_bos=True) == [[BASE] + ref.encode_ordinary(t) for t in TEXTS]
  run = "a" * (2 * MAX_RUN_CHARS + 7)
  text = "x " + run + " y" + " " * (MAX_RUN_CHARS + 3) + "z"
  # Cut as tokenization_kimi.py cuts: inside a run, every MAX_RUN_CHARS characters from the run's start.
  cuts = [text[:2 + MAX_RUN_CHARS], run[MAX_RUN_CHARS:2 * MAX_RUN_CHARS],
          run[2 * MAX_RUN_CHARS:] + " y" + " " * MAX_RUN_CHARS, "   z"]
  assert "".join(cuts) == text
  assert tok.encode(text) == [t for c in cuts for t in ref.encode_ordinary(c)]
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode_batch([text, "hi"]) == [tok.encode(text), tok.encode("hi")]


def test_decode_specials_and_range(tok):
  ids = [BASE] + tok.encode("hi") + [BASE + 2]
  assert tok.decode(ids) == "hi"
  assert tok.decode(ids, skip_special_tokens=False) == "[BOS]hi<|im_end|>"
  with pytest.raises(TokenizerError, match=r"out of range \[0, 2304\)"):
    tok.decode([5, BASE + 256])
  with pytest.raises(TokenizerError, match="out of range"):
    tok.decode([-1])


def _split_chars(tok, text):
  """Token boundaries of `text` that fall inside a character."""
  ends, at = [], 0
  for i in tok.encode(text):
    at += len(tok.token_bytes(i))
    ends.append(at)
  starts = {len(text[:k].encode()) for k in range(len(text) + 1)}
  return [e for e in ends if e not in starts]


STREAM_TEXTS = ["龘𠀋 今天天气很好 🙂 emoji 👨‍👩‍👧 and 中文。", "学习一门新的语言需要时间和耐心！🇨🇳🇨🇳", "plain ascii only"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_decode_across_split_characters(tok, text):
  ids = tok.encode(text)
  if text != "plain ascii only":
    assert _split_chars(tok, text), "the text must have tokens that end inside a character"
  prompt = tok.encode("你好，")
  stream = TextStream(tok, prompt, stop=(), hidden_ids=tok.stop_ids)
  deltas = [stream.add(i) for i in ids + [BASE + 2]]
  deltas.append(stream.finish())
  assert "".join(deltas) == text == tok.decode(ids)
  assert not any("\ufffd" in d for d in deltas)
  assert [stream.decoded[a:b] for a, b in stream.spans][-1] == ""   # <|im_end|>: a stop id, no text
  assert "".join(stream.decoded[a:b] for a, b in stream.spans) == text


def test_streaming_stop_string_in_chinese(tok):
  text = "北京是中国的首都，上海是中国最大的城市。"
  stream = TextStream(tok, [], stop=("上海",))
  out = "".join(stream.add(i) for i in tok.encode(text)) + stream.finish()
  assert out == "北京是中国的首都，" and stream.stopped


def test_loader_picks_the_kind(tmp_path):
  assert isinstance(load_tokenizer(FIXTURE), KimiTokenizer)
  assert isinstance(load_tokenizer(str(FIXTURE)), KimiTokenizer)
  if DEMO_SP.is_file():
    assert isinstance(load_tokenizer(DEMO_SP), SentencePieceTokenizer)
  assert load_tokenizer(None, vocab_size=10).ids_only
  with pytest.raises(TokenizerError, match=f"directory '{tmp_path}' has no tiktoken.model.*sentencepiece"):
    load_tokenizer(tmp_path)
  with pytest.raises(TokenizerError, match="tokenizer file not found: .*nope.*tiktoken.model"):
    load_tokenizer(tmp_path / "nope")


def _copy(tmp_path) -> pathlib.Path:
  d = tmp_path / "tok"
  shutil.copytree(FIXTURE, d)
  return d


def _edit_config(d, **changes):
  path = d / "tokenizer_config.json"
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def test_load_errors_name_the_file(tmp_path):
  with pytest.raises(TokenizerError, match="not found"):
    KimiTokenizer(tmp_path / "missing")
  with pytest.raises(TokenizerError, match="is a directory.*got the file"):
    KimiTokenizer(FIXTURE / "tiktoken.model")
  d = _copy(tmp_path)
  (d / "tokenizer_config.json").unlink()
  with pytest.raises(TokenizerError, match="has no tokenizer_config.json"):
    KimiTokenizer(d)
  shutil.rmtree(d)

  d = _copy(tmp_path)
  with open(d / "tiktoken.model", "a") as f:
    f.write("not-base64!! 5\n")
  with pytest.raises(TokenizerError, match=r"tiktoken.model:2049: expected '<base64 token bytes> <rank>'"):
    KimiTokenizer(d)
  lines = (FIXTURE / "tiktoken.model").read_text().splitlines()
  (d / "tiktoken.model").write_text("\n".join(lines[:-1] + [lines[-1].split()[0] + " 5000"]) + "\n")
  with pytest.raises(TokenizerError, match=r"ranks must be 0\.\.2047"):
    KimiTokenizer(d)
  (d / "tiktoken.model").write_text("\n".join(lines[1:]) + "\n")
  with pytest.raises(TokenizerError, match="ranks must be|lacks single-byte"):
    KimiTokenizer(d)
  shutil.copy(FIXTURE / "tiktoken.model", d / "tiktoken.model")

  _edit_config(d, bos_token="<|nope|>")
  with pytest.raises(TokenizerError, match="bos_token '<\\|nope\\|>' is not one of the special tokens"):
    KimiTokenizer(d)
  _edit_config(d, bos_token={"content": "[BOS]"}, added_tokens_decoder={"5": {"content": "[X]"}})
  with pytest.raises(TokenizerError, match="id 5, inside the base vocabulary"):
    KimiTokenizer(d)
  (d / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(TokenizerError, match="cannot read .*tokenizer_config.json.* as JSON"):
    KimiTokenizer(d)


def test_config_variants(tmp_path):
  d = _copy(tmp_path)
  _edit_config(d, bos_token={"content": "[BOS]", "special": True}, pad_token=None, chat_template=None)
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [BASE + 2, BASE + 9]}))
  t = KimiTokenizer(d)
  assert t.bos_id == BASE and t.pad_id is None and t.chat_template is None
  assert t.stop_ids == {BASE + 1, BASE + 2, BASE + 9}
  (d / "chat_template.jinja").write_text("{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}")
  t = KimiTokenizer(d)   # the .jinja file is the template (transformers prefers it too)
  assert t.render_chat([{"role": "user", "content": "hi"}]) == "<|im_user|>hi<|im_end|>"
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
  with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id 'x'"):
    KimiTokenizer(d)


def test_fits_a_kimi_config(tok):
  # Kimi's model config ends generation at <|im_end|> (eos_token_id 163586) while tokenizer_config.json's
  # eos_token is [EOS] (163585): both are stop ids, so the tokenizer fits.
  config = {"vocab_size": BASE + 256, "bos_token_id": BASE, "eos_token_id": BASE + 2, "pad_token_id": BASE + 255}
  check_tokenizer_fits(tok, config)
  with pytest.raises(TokenizerError, match="bos id is 2048 but bos_token_id=1.*eos id is 2049 but eos_token_id=7"):
    check_tokenizer_fits(tok, {**config, "bos_token_id": 1, "eos_token_id": 7})
  with pytest.raises(TokenizerError, match="it has 2304 tokens but vocab_size=2000"):
    check_tokenizer_fits(tok, {**config, "vocab_size": 2000})
