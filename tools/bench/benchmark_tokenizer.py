"""Tokenizer speed: tokens per second of the Kimi tokenizer beside the `tiktoken` library's own encode.

Usage:
  python -m tools.bench.benchmark_tokenizer [--tokenizer DIR] [--text FILE] [--repeat N] [--json FILE]

DIR is a Kimi tokenizer directory (tiktoken.model + tokenizer_config.json; default: the test fixture
tests/fixtures/kimi_tokenizer of a checkout). FILE is the long document (UTF-8); default: a generated
mixed English/Chinese document of about 1 MB. Measures, best of N runs each:

  encode (ours)      KimiTokenizer.encode of the whole document;
  encode (tiktoken)  the same Encoding's encode_ordinary called directly on the whole document (ours
                     adds the check for runs over 25,000 characters and, as Kimi's tokenizer does,
                     encodes a document over 400,000 characters in windows of that size);
  decode (ours)      KimiTokenizer.decode of the document's ids;
  chat 20 turns      KimiTokenizer.encode_chat of a 20-message conversation (render in the jinja sandbox,
                     mark the user's special tokens, split, encode), tokens of the prompt per second,
                     and its render alone (requests per second).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from model.data.tokenizer_kimi import MAX_ENCODE_CHARS, KimiTokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "kimi_tokenizer"

_EN = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
       "foolishness; numbers 1234 and 56.78 appear, as do tabs\tand  double  spaces.\n")
_ZH = "今天天气很好，我们一起去公园散步吧。学习一门新的语言需要时间和耐心，每天练习一点点，就会慢慢进步。\n"


def document(chars: int = 1_000_000) -> str:
  unit = _EN * 3 + _ZH + "emoji 🙂👍🏽 and ẞ ü é — “quotes”.\n"
  return (unit * (chars // len(unit) + 1))[:chars]


def conversation(turns: int = 20) -> list[dict]:
  msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
  for i in range(turns - 1):
    if i % 2 == 0:
      msgs.append({"role": "user", "content": f"Question {i}: {_EN.strip()} {_ZH.strip()} What do you think?"})
    else:
      msgs.append({"role": "assistant", "content": f"Answer {i}: {_ZH.strip()} {_EN.strip()}"})
  return msgs


def best(fn, repeat: int) -> float:
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def run(tokenizer: pathlib.Path, text: str, repeat: int) -> dict:
  tok = KimiTokenizer(tokenizer)
  enc = tok._enc   # the tiktoken Encoding itself, for the library's own speed
  ids = tok.encode(text)
  if len(text) <= MAX_ENCODE_CHARS:   # longer text is encoded in windows (as Kimi's tokenizer does)
    assert ids == enc.encode_ordinary(text)
  msgs = conversation(20)
  prompt = tok.encode_chat(msgs)
  t_ours = best(lambda: tok.encode(text), repeat)
  t_lib = best(lambda: enc.encode_ordinary(text), repeat)
  t_dec = best(lambda: tok.decode(ids), repeat)
  chat_repeat = max(repeat * 20, 50)
  t_chat = best(lambda: tok.encode_chat(msgs), chat_repeat)
  t_render = best(lambda: tok.render_chat(msgs), chat_repeat)
  return {
      "tokenizer": str(tokenizer), "document_chars": len(text), "document_tokens": len(ids),
      "encode_tokens_per_s": len(ids) / t_ours, "tiktoken_encode_tokens_per_s": len(ids) / t_lib,
      "decode_tokens_per_s": len(ids) / t_dec,
      "chat_turns": len(msgs), "chat_prompt_tokens": len(prompt.ids),
      "chat_encode_tokens_per_s": len(prompt.ids) / t_chat, "chat_encode_ms": t_chat * 1e3,
      "chat_render_ms": t_render * 1e3,
  }


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokenizer", type=pathlib.Path, default=FIXTURE, help="Kimi tokenizer directory")
  ap.add_argument("--text", type=pathlib.Path, help="long UTF-8 document (default: a generated 1 MB one)")
  ap.add_argument("--repeat", type=int, default=5, help="runs per measurement (the best is reported)")
  ap.add_argument("--json", type=pathlib.Path, help="also write the figures to this file")
  args = ap.parse_args(argv)
  if args.repeat < 1:
    ap.error("--repeat must be >= 1")
  text = args.text.read_text(encoding="utf-8") if args.text else document()
  r = run(args.tokenizer, text, args.repeat)
  print(f"document: {r['document_chars']} characters, {r['document_tokens']} tokens ({r['tokenizer']})")
  print(f"  encode (ours)      {r['encode_tokens_per_s'] / 1e6:8.2f} M tokens/s")
  print(f"  encode (tiktoken)  {r['tiktoken_encode_tokens_per_s'] / 1e6:8.2f} M tokens/s")
  print(f"  decode (ours)      {r['decode_tokens_per_s'] / 1e6:8.2f} M tokens/s")
  print(f"chat: {r['chat_turns']} messages, {r['chat_prompt_tokens']} prompt tokens")
  print(f"  render + encode    {r['chat_encode_ms']:8.3f} ms  ({r['chat_encode_tokens_per_s'] / 1e6:.2f} M tokens/s)")
  print(f"  render only        {r['chat_render_ms']:8.3f} ms")
  if args.json:
    args.json.write_text(json.dumps(r, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
