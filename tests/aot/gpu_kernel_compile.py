"""Child of tests/aot/test_gpu_kernel_compile.py (runs in `.venv-gpu-aot`): one deviceless sm_90a compile.

`python -m tests.aot.gpu_kernel_compile device=h200 dtype=bfloat16 seq_len=8192 key_dim=128 ...`
compiles `kda_inference(implementation="pallas_gpu")` (in-kernel bounded gate, q/k L2 norm, final states) with
spills as compile errors, and prints one JSON line: compile seconds and, per KDA kernel, its
tensor-core / FMA instruction counts and ptxas' registers and spill bytes.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from tools.gpu_compile import compile_kda

INT_ARGS = ("batch", "seq_len", "heads", "key_dim", "value_dim", "num_segments")


def main(argv):
  kw = {}
  for arg in argv:
    key, _, value = arg.partition("=")
    kw[key] = int(value) if key in INT_ARGS else value
  reports, seconds, _ = compile_kda(**kw)
  kernels = {name: {k: v for k, v in dataclasses.asdict(r).items() if k != "ptx"}
             for name, r in reports.items()}
  print(json.dumps({"seconds": round(seconds, 2), "kernels": kernels}))


if __name__ == "__main__":
  main(sys.argv[1:])
