"""`key=value` argument parsing for the tools whose arguments are not model-config keys
(`convert_checkpoint`, `train_tokenizer`, `unigram_baseline`); model tools use `model.config`."""

from __future__ import annotations

import difflib
from typing import Sequence


def parse_key_values(argv: Sequence[str], known: Sequence[str], error: type[Exception] = ValueError) -> dict[str, str]:
  """Parses `key=value` strings (a leading `--` on a key is tolerated).

  Args:
    argv: the arguments, e.g. `sys.argv[1:]` without `--help`.
    known: the accepted keys.
    error: the exception class raised (each tool has its own, printed as one `error:` line).

  Returns:
    `{key: value}` with values as written.

  Raises:
    `error`: an argument without `=`, an unknown key (naming the closest known keys), or a key given twice.
  """
  known = list(known)
  out: dict[str, str] = {}
  for a in argv:
    if "=" not in a:
      raise error(f"arguments are key=value, got {a!r} (see --help)")
    k, v = a.split("=", 1)
    k = k.strip().lstrip("-")
    if k not in known:
      close = difflib.get_close_matches(k, known, n=3)
      hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
      raise error(f"unknown argument {k!r}; {hint} (see --help)")
    if k in out:
      raise error(f"argument {k!r} given twice")
    out[k] = v
  return out
