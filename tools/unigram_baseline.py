"""Held-out perplexity and bits per byte of an add-one-smoothed unigram model of a tokenizer.

Usage:
  python -m tools.unigram_baseline data=FILE tokenizer_path=TOK.model [heldout_fraction=0.1]
      [add_bos=true] [add_eos=true]

The baseline a language model must beat. The corpus is split by the project's held-out rule
(`model.data.pipeline.split_heldout`: the last `heldout_fraction` of the bytes, cut at a line
start); documents are blank-line separated blocks (format "text"), tokenised and framed with bos/eos
exactly as `tools.train` and `tools.perplexity` frame them. The unigram model is fit on the training
split only, with add-one (Laplace) smoothing over the whole vocabulary:

    p(w) = (count_train(w) + 1) / (N_train + V)

where counts are over the *target* tokens (every framed token but the leading bos, i.e. what a
language model is scored on). On the held-out split:

    nll = -sum_t log p(w_t)  over held-out targets;  perplexity = exp(nll / tokens);
    bits per byte = nll / ln 2 / (UTF-8 bytes of the held-out documents)

The byte count is that of the documents' text (blank separator lines and the newlines between
documents are not scored, as in tools.perplexity). Prints one JSON object.
"""

from __future__ import annotations

import json
import math

import numpy as np

from model.data.pipeline import DataFormatError, read_documents, tokenize_documents
from model.data.tokenizer import load_tokenizer
from model.errors import UsageError
from tools import cli

DEFAULTS = {"heldout_fraction": "0.1", "add_bos": "true", "add_eos": "true"}
REQUIRED = ("data", "tokenizer_path")


def _targets(docs) -> np.ndarray:
  """Concatenated target ids: each framed document without its first token."""
  parts = [np.asarray(d[1:], np.int64) for d in docs if len(d) > 1]
  return np.concatenate(parts) if parts else np.zeros((0,), np.int64)


def unigram_baseline(data: str, tokenizer_path: str, *, heldout_fraction: float = 0.1, add_bos: bool = True,
                     add_eos: bool = True) -> dict:
  """Fits the smoothed unigram on the train split of `data` and scores the held-out split.

  Returns:
    dict: heldout_tokens, heldout_bytes, nll_per_token (nats), perplexity, bits_per_byte,
    train_tokens, vocab_size.

  Raises:
    UsageError: missing file, invalid UTF-8, an empty split.
    TokenizerError: a bad tokenizer file.
  """
  tok = load_tokenizer(tokenizer_path)
  try:
    train_docs = read_documents(data, "text", split="train", heldout_fraction=heldout_fraction)
    held_docs = read_documents(data, "text", split="heldout", heldout_fraction=heldout_fraction)
  except (FileNotFoundError, DataFormatError, ValueError) as e:
    raise UsageError(str(e)) from None
  if not train_docs or not held_docs:
    raise UsageError(f"data={data!r}: the {'training' if not train_docs else 'held-out'} split holds no documents")
  train = _targets(tokenize_documents(train_docs, tok, add_bos=add_bos, add_eos=add_eos))
  held = _targets(tokenize_documents(held_docs, tok, add_bos=add_bos, add_eos=add_eos))
  v = tok.vocab_size
  counts = np.bincount(train, minlength=v).astype(np.float64)
  logp = np.log(counts + 1.0) - math.log(counts.sum() + v)
  nll = float(-logp[held].sum())
  n_bytes = sum(len(d.encode("utf-8")) for d in held_docs)
  return {"heldout_tokens": int(held.size), "heldout_bytes": n_bytes, "nll_per_token": nll / held.size,
          "perplexity": math.exp(nll / held.size), "bits_per_byte": nll / math.log(2) / n_bytes,
          "train_tokens": int(train.size), "vocab_size": v}


def _bool(key, text):
  if text.lower() not in ("true", "false"):
    raise UsageError(f"{key} expects true or false, got {text!r}")
  return text.lower() == "true"


def run(argv: list[str]) -> int:
  """Fits and scores the unigram baseline the arguments describe; raises on bad input."""
  args = cli.parse_key_values(argv, REQUIRED + tuple(DEFAULTS), UsageError)
  missing = [k for k in REQUIRED if not args.get(k)]
  if missing:
    raise UsageError(f"missing required argument(s): {', '.join(missing)} (see --help)")
  full = {**DEFAULTS, **args}
  try:
    fraction = float(full["heldout_fraction"])
  except ValueError:
    raise UsageError(f"heldout_fraction expects a number, got {full['heldout_fraction']!r}") from None
  result = unigram_baseline(args["data"], args["tokenizer_path"], heldout_fraction=fraction,
                            add_bos=_bool("add_bos", full["add_bos"]), add_eos=_bool("add_eos", full["add_eos"]))
  print(json.dumps(result, indent=2))
  return 0


main = cli.tool_main(run, __doc__)
command = cli.command(main)

if __name__ == "__main__":
  command()
