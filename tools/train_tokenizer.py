r"""Trains a sentencepiece tokenizer on the training split of a UTF-8 text file.

Usage:
  python -m tools.train_tokenizer input=FILE model_prefix=PATH vocab_size=N \
      [model_type=bpe|unigram] [heldout_fraction=0.1] [character_coverage=1.0] [overwrite=false]

Writes PATH.model (load it with `model.data.tokenizer.SentencePieceTokenizer`) and PATH.vocab (one
"piece<TAB>score" line per id, backslash/newline/tab escaped as \\, \n, \t; for reading only).
Each is written to a temporary file and renamed into place. When PATH.model or PATH.vocab already
exists the tool refuses before reading the input, unless overwrite=true (then both are replaced),
like tools.convert_checkpoint's output_path.

The last `heldout_fraction` of the file (by bytes, cut at a line boundary: the project's held-out
rule, `model.data.pipeline.split_heldout`) is never seen by the trainer. Each remaining non-blank
line is one training sentence.

The model is set up so that decode(encode(text)) == text for any UTF-8 string:
  * byte_fallback: characters outside the learned pieces become <0xNN> byte tokens, never <unk>;
  * identity normalization, no whitespace collapsing, no dummy leading space;
  * "\n" is a user-defined piece (sentencepiece trains line by line and would otherwise only ever
    see newlines as byte fallback).
Special ids: pad=0, unk=1, bos=2, eos=3; ids 4.. are "\n", the 256 byte pieces, then the learned
pieces. vocab_size must therefore be at least 4 + 1 + 256 + (distinct characters kept by
character_coverage): 325 for tinyshakespeare (64 distinct characters besides "\n").

The special ids are fixed on purpose: they are the ids of configs/demo.py and of the shipped demo
tokenizer (kda_plugin/assets/demo/tokenizer.model, made by this tool), so a tokenizer from here fits
the demo config as is. Other configs keep their own ids (tiny: bos 1, eos 2, like the HF test
fixtures): tools.train / generate / perplexity then refuse the pair with one error that lists every
mismatch and the overrides that fix them all, e.g. "pass vocab_size=325 bos_token_id=2 eos_token_id=3".

Prints the split sizes and the held-out compression (UTF-8 bytes per token).
"""

from __future__ import annotations

import io
import os
import re
import time

import sentencepiece as spm

from model.data.pipeline import DataFormatError, read_text_file, split_heldout
from model.atomic import atomic_writer
from model.errors import UsageError
from tools import cli

SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
REQUIRED = ("input", "model_prefix", "vocab_size")
DEFAULTS = {"model_type": "bpe", "heldout_fraction": "0.1", "character_coverage": "1.0", "overwrite": "false"}


def parse_args(argv: list[str]) -> dict:
  """`key=value` arguments -> typed dict.

  Raises:
    UsageError: an argument without '=', an unknown or repeated key, a missing required key, or a
      value of the wrong type/range.
  """
  args = cli.parse_key_values(argv, REQUIRED + tuple(DEFAULTS), UsageError)
  missing = [k for k in REQUIRED if k not in args]
  if missing:
    raise UsageError(f"missing required argument(s): {', '.join(missing)} (see --help)")
  for k, v in DEFAULTS.items():
    args.setdefault(k, v)
  out = {"input": args["input"], "model_prefix": args["model_prefix"]}
  for key, kind, what in (("vocab_size", int, "an integer"), ("heldout_fraction", float, "a number"),
                          ("character_coverage", float, "a number")):
    try:
      out[key] = kind(args[key])
    except ValueError:
      raise UsageError(f"{key}={args[key]!r}: expected {what}") from None
  if out["vocab_size"] < 1:
    raise UsageError(f"vocab_size must be a positive integer, got {out['vocab_size']}")
  if not 0.0 < out["heldout_fraction"] < 1.0:
    raise UsageError(f"heldout_fraction must be in (0, 1), got {out['heldout_fraction']}")
  if not 0.0 < out["character_coverage"] <= 1.0:
    raise UsageError(f"character_coverage must be in (0, 1], got {out['character_coverage']}")
  if args["model_type"] not in ("bpe", "unigram"):
    raise UsageError(f"model_type must be 'bpe' or 'unigram', got {args['model_type']!r}")
  out["model_type"] = args["model_type"]
  if args["overwrite"].lower() not in ("true", "false"):
    raise UsageError(f"overwrite must be true or false, got {args['overwrite']!r}")
  out["overwrite"] = args["overwrite"].lower() == "true"
  if not out["model_prefix"] or out["model_prefix"].endswith(os.sep):
    raise UsageError(f"model_prefix must be a file path prefix, got {out['model_prefix']!r}")
  return out


def output_paths(model_prefix: str, overwrite: bool = False) -> tuple[str, str]:
  """`(PATH.model, PATH.vocab)` of `model_prefix`, checked before any work.

  Raises:
    UsageError naming model_prefix: one of them is a directory, or exists and `overwrite` is false.
  """
  paths = (model_prefix + ".model", model_prefix + ".vocab")
  for path in paths:
    if os.path.isdir(path):
      raise UsageError(f"model_prefix={model_prefix!r}: {path!r} is a directory")
  existing = [p for p in paths if os.path.lexists(p)]
  if existing and not overwrite:
    raise UsageError(f"model_prefix={model_prefix!r}: {' and '.join(map(repr, existing))} already "
                     f"exist{'s' if len(existing) == 1 else ''}; pass overwrite=true to replace "
                     f"{'it' if len(existing) == 1 else 'them'}")
  return paths


def _write_atomic(path: str, data: bytes) -> None:
  """Writes `data` to `path` through a temporary file in the same directory, then renames it; the
  file gets the umask's mode (0o666 less the umask), as a plain `open()` gives."""
  with atomic_writer(path, "wb") as f:
    f.write(data)


def train_tokenizer(input: str, model_prefix: str, vocab_size: int, *, model_type: str = "bpe",
                    heldout_fraction: float = 0.1, character_coverage: float = 1.0,
                    num_threads: int | None = None, overwrite: bool = False) -> dict:
  """Trains and writes `model_prefix.model` / `.vocab` from the training split of `input`
  (each atomically; existing files only with `overwrite`).

  Returns:
    dict with "model_path", "train_bytes", "heldout_bytes", "train_lines", "heldout_tokens" and
    "heldout_bytes_per_token".

  Raises:
    UsageError: missing, empty, non-UTF-8 input (naming file and line), an input that is a directory,
      an empty training split, or
      a failed sentencepiece training (e.g. vocab_size too small or too large for the data), or
      existing output files without `overwrite` (checked first, see `output_paths`).
  """
  model_path, vocab_path = output_paths(model_prefix, overwrite)
  if os.path.isdir(input):
    raise UsageError(f"input={input!r} is a directory; expected a UTF-8 text file")
  try:
    text = read_text_file(input)
  except (FileNotFoundError, DataFormatError) as e:
    raise UsageError(str(e)) from None
  if not text.strip():
    raise UsageError(f"input file is empty (no non-blank text): {input!r}")
  train, heldout = split_heldout(text, heldout_fraction)
  lines = [line for line in train.split("\n") if line.strip()]
  if not lines:
    raise UsageError(f"the training split of {input!r} is empty: the file has a single line, so "
                     f"the held-out rule leaves nothing to train on")
  parent = os.path.dirname(os.path.abspath(model_prefix))
  os.makedirs(parent, exist_ok=True)
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        user_defined_symbols=["\n"], allow_whitespace_only_pieces=True, split_digits=True,
        max_sentence_length=1 << 16, num_threads=num_threads or min(8, os.cpu_count() or 1),
        minloglevel=2, **SPECIAL_IDS)
  except RuntimeError as e:
    hint = ""
    m = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
    if m:  # byte pieces, specials and every kept character need an id before any merge
      hint = f" (this data needs vocab_size >= {int(m.group(1))})"
    raise UsageError(f"sentencepiece training failed for vocab_size={vocab_size}{hint}: {e}") from None
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  # For people only (loading uses .model): one "piece<TAB>score" line per id, with backslash,
  # newline and tab escaped so the "\n" piece does not break the one-line-per-id layout.
  vocab_lines = []
  for i in range(sp.vocab_size()):
    piece = sp.id_to_piece(i).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    vocab_lines.append(f"{piece}\t{sp.get_score(i)}\n")
  _write_atomic(model_path, model.getvalue())
  _write_atomic(vocab_path, "".join(vocab_lines).encode("utf-8"))
  heldout_tokens = len(sp.encode(heldout)) if heldout else 0
  heldout_bytes = len(heldout.encode("utf-8"))
  return {
      "model_path": model_path,
      "train_bytes": len(train.encode("utf-8")),
      "heldout_bytes": heldout_bytes,
      "train_lines": len(lines),
      "heldout_tokens": heldout_tokens,
      "heldout_bytes_per_token": heldout_bytes / heldout_tokens if heldout_tokens else float("nan"),
  }


def run(argv: list[str]) -> int:
  """Trains the tokenizer the arguments describe and prints a summary; raises on bad input."""
  if not argv:  # nothing given: the help, as a usage error
    print(__doc__)
    return 2
  args = parse_args(argv)
  t0 = time.perf_counter()
  stats = train_tokenizer(**args)
  stats["seconds"] = time.perf_counter() - t0
  print(f"wrote {stats['model_path']} (vocab_size={args['vocab_size']}, {args['model_type']}) in "
        f"{stats['seconds']:.1f}s; trained on {stats['train_bytes']} bytes / {stats['train_lines']} "
        f"lines; held out {stats['heldout_bytes']} bytes = {stats['heldout_tokens']} tokens "
        f"({stats['heldout_bytes_per_token']:.3f} bytes/token)")
  return 0


main = cli.tool_main(run, __doc__)
command = cli.command(main)

if __name__ == "__main__":
  command()
