r"""MLA prefill attention on one device: splash (Pallas TPU) against tiled (XLA), forward, bfloat16.

    python tools/bench/benchmark_mla_attention.py [--heads 8] [--runs 10] [--json FILE]

Shapes (one row each, q/k head dim 192, v 128 as Kimi-Linear's MLA): 8192 tokens as one document,
8192 tokens as 16 packed documents of 512 (the packed-prefill case of issue 35), 32768 tokens as one
document. Per shape and implementation: device milliseconds per call (`--runs` calls dispatched,
blocked once, divided; median and spread of 3 repeats; compilation excluded), and the largest
|splash - tiled| of the outputs (tiled computes in float32, splash feeds the MXU bfloat16).
"tiled" skips tile pairs of different documents, "splash" only those above the diagonal: the
16-document row shows what that costs. Needs a TPU for splash (elsewhere only tiled runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from model.nn import attention

SHAPES = (("8192 x 1 document", 8192, 1), ("8192 x 16 documents of 512", 8192, 16),
          ("32768 x 1 document", 32768, 1))


def _device_ms(fn, args, runs):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(3):
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(runs)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) * 1e3 / runs)
  return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
          "max_ms": round(max(times), 3)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--runs", type=int, default=10)
  ap.add_argument("--json", default=None, help="also write the report here")
  args = ap.parse_args(argv)
  impls = ["splash", "tiled"] if jax.default_backend() == "tpu" else ["tiled"]
  rng = np.random.default_rng(0)
  report = {"backend": jax.default_backend(), "jax": jax.__version__, "heads": args.heads, "cases": []}
  for name, t, docs in SHAPES:
    q, k, v = (jnp.asarray(rng.normal(0, 1, (1, t, args.heads, d)), jnp.bfloat16) for d in (192, 192, 128))
    seg = jnp.asarray(np.repeat(np.arange(1, docs + 1), t // docs)[None].astype(np.int32))
    outs, case = {}, {"shape": name}
    for impl in impls:
      fn = jax.jit(lambda q, k, v, s, impl=impl: attention.segment_attention(
          q, k, v, s, scale=192 ** -0.5, impl=impl)[0])
      outs[impl] = fn(q, k, v, seg)
      case[impl] = _device_ms(fn, (q, k, v, seg), args.runs)
    if len(outs) == 2:
      case["max_abs_diff_splash_tiled"] = float(jnp.max(jnp.abs(outs["splash"] - outs["tiled"])))
    report["cases"].append(case)
    print(json.dumps(case), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
