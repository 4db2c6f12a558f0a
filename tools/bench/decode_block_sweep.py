"""Device time of the decode-step kernel for each block of sequences per grid step (BB), on a TPU.

The kernel picks BB from an ASSUMED per-step overhead (`decode_pallas_tpu.STEP_OVERHEAD_S`); this
times every BB that divides B and fits VMEM, beside the kernel's own choice, so the chip can settle
it. Same loop as tools/bench/kernel_device_time.py's decode rows (`compile_decode_loop`: state in
HBM, carried in place; median of `--repeats` loops with min/max).

    python -m tools.bench.decode_block_sweep --batch 32 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from tools.bench.kernel_device_time import HBM_BYTES_PER_S, compile_decode_loop, decode_hbm_bytes, decode_inputs


def _kernel_fn(b, h, bb, kd=128, vd=128):
  """(fn(state) -> (new state, o), state): the kernel on decode_inputs with BB = `bb`."""
  from kda_plugin.ops import decode_pallas_tpu  # noqa: PLC0415  (after jax is configured)
  q, k, v, g, beta, state = decode_inputs(b, h, kd, vd)

  def step(s):
    o, s2 = decode_pallas_tpu.decode_step_tpu(s, q, k, v, g, beta.astype(jnp.float32), scale=kd ** -0.5,
                                              seqs_per_step_override=bb)
    return s2, o
  return step, state


def _time(fn, x, repeats, loop_ms):
  compiled = compile_decode_loop(fn, x)
  jax.block_until_ready(compiled(x, jnp.int32(4)))
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(x, jnp.int32(4)))
  iters = int(min(2000, max(8, loop_ms / max((time.perf_counter() - t0) / 4 * 1e3, 1e-3))))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(x, jnp.int32(iters)))
    samples.append((time.perf_counter() - t0) * 1e3 / iters)
  return samples


def main(argv=None) -> int:
  from kda_plugin.ops import decode_pallas_tpu  # noqa: PLC0415
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
  ap.add_argument("--heads", type=int, default=24)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--loop-ms", type=float, default=40.0)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if jax.default_backend() != "tpu":
    print("decode_block_sweep times the Mosaic kernel: it needs a TPU", file=sys.stderr)
    return 2
  rows = []
  for b in args.batch:
    h = args.heads
    chosen = decode_pallas_tpu.seqs_per_step(b, h, 128, 128)
    for bb in [d for d in range(1, b + 1) if b % d == 0
               and decode_pallas_tpu.vmem_limit_bytes(d, h, 128, 128) <= decode_pallas_tpu.MAX_VMEM_BYTES]:
      fn, x = _kernel_fn(b, h, bb)
      hbm = decode_hbm_bytes(b, h)
      s = _time(fn, x, args.repeats, args.loop_ms)
      med = statistics.median(s)
      rows.append(dict(batch=b, heads=h, seqs_per_step=bb, steps=b // bb, chosen=bb == chosen,
                       median_ms=round(med, 4), min_ms=round(min(s), 4), max_ms=round(max(s), 4),
                       hbm_floor_ms=round(hbm / HBM_BYTES_PER_S * 1e3, 4)))
      print(f"B={b:4d} BB={bb:3d} steps={b // bb:4d} {med:8.4f} ms [{min(s):.4f}, {max(s):.4f}]"
            f"{'  <- chosen' if bb == chosen else ''}", flush=True)
  out = dict(tool="tools.bench.decode_block_sweep", jax=jax.__version__, device=jax.devices()[0].device_kind,
             rows=rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
