r"""Checks a project checkpoint directory: every parameter against its recorded checksum, and finite.

Usage:
  python -m tools.verify_checkpoint load_parameters_path=DIR [allow_non_finite=false] [record_checksums=false]

Keys:
  load_parameters_path  the checkpoint directory (config.json + params/ + checksums.json).
  allow_non_finite      true: do not refuse parameters holding NaN or Inf (they are still reported as
                        accepted); default false: the first such parameter is an error.
  record_checksums      true: for a checkpoint written before checksums were recorded (no
                        checksums.json), compute them from what params/ holds now and write
                        DIR/checksums.json (atomically). It trusts the stored bytes: use it only on a
                        copy you know to be good. Refused when checksums.json exists.

Reads every parameter once, piece by piece (host memory: ~256 MB or the largest parameter), and
compares zlib's CRC-32 of its bytes with DIR/checksums.json, and so the files the checkpoint carries
(its tokenizer, hf_config.json) that checksums.json lists, as loading does
(`model.checkpoint.format.check_parameters`; generate, perplexity, serve and training's
load_parameters_path verify the same way unless `verify_checksums=false`).

Prints one line `ok: DIR: N parameters, X GB, checksums match (crc32), all finite, in T s` and exits 0.
Exit 1: no checksums.json (nothing to verify against; the parameters were still read and checked
for non-finite values). Exit 2, one `error:` line: a parameter whose bytes do not match its
checksum (named, with both CRCs), a non-finite parameter (named), an unreadable or truncated
params/, or a bad argument.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from model.checkpoint import format as ck
from model.errors import UsageError
from tools import cli

KEYS = ("load_parameters_path", "allow_non_finite", "record_checksums")


def _bool(raw: dict, key: str) -> bool:
  v = raw.get(key, "false").strip().lower()
  if v not in ("true", "false"):
    raise UsageError(f"{key} must be true or false, got {raw[key]!r}")
  return v == "true"


def run(argv: Sequence[str]) -> int:
  """Verifies (or records the checksums of) the checkpoint the `key=value` arguments name."""
  raw = cli.parse_key_values(argv, KEYS)
  path = raw.get("load_parameters_path", "").strip()
  if not path:
    raise UsageError("missing required argument load_parameters_path=DIR (the checkpoint to verify)")
  allow, record = _bool(raw, "allow_non_finite"), _bool(raw, "record_checksums")
  t0 = time.perf_counter()
  if record:
    n = ck.record_checksums(path)
    print(f"recorded crc32 checksums of {n} parameters in {path}/{ck.CHECKSUMS_FILE} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0
  res = ck.check_parameters(path, verify_checksums=True, allow_non_finite=allow)
  seconds = time.perf_counter() - t0
  finite = "non-finite values not checked" if allow else "all finite"
  if not res["checksums"]:
    print(f"unverified: {path}: {res['parameters']} parameters, {res['bytes'] / 1e9:.3f} GB readable and "
          f"{finite}, but no {ck.CHECKSUMS_FILE} to check them against ({seconds:.1f} s)")
    return 1
  files = f" and {res['files']} carried file(s) (tokenizer, hf_config.json)" if res.get("files") else ""
  print(f"ok: {path}: {res['parameters']} parameters, {res['bytes'] / 1e9:.3f} GB{files}, checksums match (crc32), "
        f"{finite}, in {seconds:.1f} s")
  return 0


main = cli.tool_main(run, __doc__)
command = cli.command(main)

if __name__ == "__main__":
  command()
