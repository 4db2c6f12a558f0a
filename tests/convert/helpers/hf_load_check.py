"""Loads HF directories with transformers' KimiLinearForCausalLM and compares logits to goldens.

Run with the reference venv (Python 3.11, torch CPU + transformers; see tests/fixtures/README.md):
  .venv-ref/bin/python tests/convert/helpers/hf_load_check.py HF_DIR REFERENCE_NPZ [HF_DIR REFERENCE_NPZ ...]
Prints one JSON line per directory: {"path", "max_abs_logits", "missing", "unexpected", "dtype"} and
exits non-zero when transformers reports missing/unexpected weights or cannot load the directory.
"""

import json
import sys

import numpy as np
import torch
from transformers import KimiLinearForCausalLM


def check(path: str, npz: str) -> dict:
  ref = np.load(npz)
  model, info = KimiLinearForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    logits = model(torch.as_tensor(ref["input_ids"], dtype=torch.long), use_cache=False).logits
  return {"path": path, "max_abs_logits": float(np.max(np.abs(logits.numpy() - ref["logits"]))),
          "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
          "mismatched": [str(m) for m in info.get("mismatched_keys", [])]}


def main(argv):
  ok = True
  for path, npz in zip(argv[::2], argv[1::2]):
    r = check(path, npz)
    ok &= not (r["missing"] or r["unexpected"] or r["mismatched"])
    print(json.dumps(r))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
