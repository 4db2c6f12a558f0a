"""Device time of the MoE's grouped matmuls (megablox `gmm`) for each tiling, on a TPU.

The model's experts run three grouped matmuls per MoE layer: `[rows, d] x w1/w3 [E, d, I]` and
`[rows, I] x w2 [E, I, d]`, rows = tokens x num_experts_per_tok sorted by expert and padded to the
row tile (model/nn/moe.py `Experts._megablox`). This times each `(tm, tk, tn)` that fits VMEM for
those two problem shapes at each token count, beside the tiling the model picks now
(`moe.gmm_tiling`), so the chip settles the tile policy. Group sizes come from a random balanced
routing (each token's experts drawn without replacement), the last group taking the padding as in
the model.

Timing: one jit runs `--loops` gmm calls in a `lax.fori_loop`, each call's input depending on the last
one's output through one element (written in place), so no call is hoisted or skipped; the figure is
that loop's device time / loops (`--loops`; `--long-loops` from 8192 rows), median of `--repeats`
with min and max. Floors beside each row: the
MXU floor (2 x routed rows x k x n at 197 TFLOP/s; the padding rows excluded) and the HBM floor (the
routed experts' weights + the rows in and out once, at 819 GB/s).

    python -m tools.bench.moe_tiling_sweep --json out.json     # real-width 48B shard, 16 experts
    python -m tools.bench.moe_tiling_sweep --config kimi_linear_48b_pattern_0p9b --tokens 8192 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

import numpy as np

PEAK_FLOPS = 197e12
HBM_BYTES_PER_S = 819e9
VMEM_BUDGET = 15 * 2**20   # v5e's default scoped VMEM is 16 MiB; megablox sets no other limit
ROW_TILES = (128, 256, 512, 1024)


def dividing_tiles(x: int) -> list[int]:
  """Multiples of 128 of at least 256 that divide `x` (no masked ragged tile), else [128]."""
  return [t for t in range(256, x + 1, 128) if x % t == 0] or [128]


def candidates(rows: int, k: int, n: int) -> list[tuple[int, int, int]]:
  """Every `(tm, tk, tn)` that fits `VMEM_BUDGET`: tk and tn from `dividing_tiles`, tm a row tile
  not above the rows padded to 128 (a decode's rows fit one tile)."""
  from model.nn.moe import gmm_vmem_bytes  # noqa: PLC0415  (jax: imported after the arguments are checked)
  out = []
  for tm in ROW_TILES:
    if tm > max(128, -(-rows // 128) * 128):
      continue
    for tk in dividing_tiles(k):
      for tn in dividing_tiles(n):
        if gmm_vmem_bytes(tm, tk, tn) <= VMEM_BUDGET:
          out.append((tm, tk, tn))
  return out


def group_sizes(tokens: int, top_k: int, experts: int, rows: int, seed: int = 0) -> np.ndarray:
  """int32 `[experts]`: a random routing of `tokens` to `top_k` distinct experts each, the padding up
  to `rows` added to the last group (as the model does)."""
  rng = np.random.default_rng(seed)
  choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
  sizes = np.bincount(choice.reshape(-1), minlength=experts).astype(np.int32)
  sizes[-1] += rows - tokens * top_k
  return sizes


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
  p.add_argument("--config", default="kimi_linear_48b_a3b", help="model config name (default: %(default)s)")
  p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                 help="config overrides (default: num_experts=16, the real-width shard)")
  p.add_argument("--tokens", type=int, nargs="+", default=[8192, 64, 32, 8],
                 help="token counts to time (8192: a prefill; 8-64: decode batches) (default: %(default)s)")
  p.add_argument("--loops", type=int, default=20, help="gmm calls per timed loop (default: %(default)s)")
  p.add_argument("--long-loops", type=int, default=4,
                 help="gmm calls per timed loop from 8192 rows up (prefill: milliseconds a call) (default: %(default)s)")
  p.add_argument("--repeats", type=int, default=5, help="timed loops per tiling (default: %(default)s)")
  p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                 help="compile threads (default: cores - 1)")
  p.add_argument("--stop-after-s", type=float, default=float("inf"),
                 help="stop timing new tilings after this many seconds (the JSON says which were not timed)")
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run; slow)")
  p.add_argument("--json", required=True, help="output JSON file (written after each problem)")
  args = p.parse_args(argv)
  for name in ("loops", "long_loops", "repeats", "threads"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if any(t < 1 for t in args.tokens):
    p.error(f"--tokens must be >= 1 each, got {args.tokens}")
  if args.stop_after_s <= 0:
    p.error(f"--stop-after-s must be > 0, got {args.stop_after_s}")
  out_dir = os.path.dirname(os.path.abspath(args.json))
  if not os.path.isdir(out_dir):
    p.error(f"--json {args.json}: directory {out_dir} does not exist")

  import jax  # noqa: PLC0415  (after argument errors: a bad flag should not wait for jax)
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # noqa: PLC0415

  from model.config import load_config  # noqa: PLC0415
  from model.nn import moe  # noqa: PLC0415

  from model.errors import ConfigError  # noqa: PLC0415

  if jax.default_backend() != "tpu" and not args.interpret:
    p.error(f"megablox runs on a TPU; this backend is {jax.default_backend()!r} (--interpret: a CPU smoke run)")
  overrides = ["num_experts=16"] if args.set is None else args.set
  try:
    cfg = load_config([args.config, "dtype=bfloat16", "weight_dtype=bfloat16", *overrides])
  except ConfigError as err:
    p.error(f"--config/--set: {err}")
  e, d, i, top_k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
  t_start = time.perf_counter()
  result = {"config": args.config, "overrides": overrides, "experts": e, "hidden": d, "moe_intermediate": i,
            "top_k": top_k, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "loops": args.loops, "repeats": args.repeats, "vmem_budget_bytes": VMEM_BUDGET,
            "problems": []}

  def write():
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
      json.dump(result, f, indent=1)
    os.replace(tmp, args.json)

  key = jax.random.key(0)
  for tokens in args.tokens:
    m = tokens * top_k
    loops = args.long_loops if m >= 8192 else args.loops
    for name, (k, n) in (("w1/w3", (d, i)), ("w2", (i, d))):
      rhs = (jax.random.normal(key, (e, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
      now = moe.gmm_tiling(-(-m // moe.GMM_ROWS) * moe.GMM_ROWS if m < moe.GMM_LONG_ROWS
                           else -(-m // moe.GMM_LONG_TM) * moe.GMM_LONG_TM, k, n)
      tilings = candidates(m, k, n)
      if now not in tilings:
        tilings.append(now)
      routed_experts = int(np.count_nonzero(np.bincount(
          np.argsort(np.random.default_rng(0).random((tokens, e)), axis=1)[:, :top_k].reshape(-1), minlength=e)))
      prob = {"tokens": tokens, "matmul": name, "rows": m, "k": k, "n": n, "loops": loops, "model_tiling": list(now),
              "mxu_floor_ms": 2 * m * k * n / PEAK_FLOPS * 1e3,
              "hbm_floor_ms": (routed_experts * k * n + m * (k + n)) * 2 / HBM_BYTES_PER_S * 1e3,
              "tilings": []}

      def lower(tiling, k=k, n=n, m=m, rhs=rhs):
        tm = tiling[0]
        rows = -(-m // tm) * tm
        sizes = jnp.asarray(group_sizes(tokens, top_k, e, rows))
        lhs = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)   # made when timed: one in HBM at a time

        def loop(lhs, rhs, sizes):
          def body(_, x):
            y = gmm(x, rhs, sizes, jnp.bfloat16, tiling, None, None, False, args.interpret)
            return x.at[0, 0].set(y[0, 0] * 0 + x[0, 0] + 1)
          return jax.lax.fori_loop(0, loops, body, lhs)[0, 0]

        return jax.jit(loop, donate_argnums=0).lower(lhs, rhs, sizes), (lhs, rhs, sizes)

      lowered = []
      for tiling in tilings:
        try:
          lowered.append((tiling, *lower(tiling)))
        except Exception as err:  # noqa: BLE001  (a tiling megablox refuses: recorded, the sweep goes on)
          prob["tilings"].append({"tiling": list(tiling), "error": f"{type(err).__name__}: {err}"[:300]})

      def compile_one(item):
        tiling, low, inputs = item
        try:
          return tiling, low.compile(), inputs, None
        except Exception as err:  # noqa: BLE001
          return tiling, None, inputs, f"{type(err).__name__}: {err}"[:300]

      with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        compiled = list(pool.map(compile_one, lowered))
      for tiling, exe, (lhs, rhs_, sizes), err in compiled:
        row = {"tiling": list(tiling), "vmem_bytes": moe.gmm_vmem_bytes(*tiling)}
        if err is not None:
          prob["tilings"].append({**row, "error": err})
          continue
        if time.perf_counter() - t_start > args.stop_after_s:
          prob["tilings"].append({**row, "skipped": "time limit"})
          continue
        runs = []
        lhs = jax.random.normal(jax.random.key(1), lhs.shape, jnp.float32).astype(lhs.dtype)
        for r in range(args.repeats + 1):
          x = jnp.array(lhs)   # the loop donates its input
          jax.block_until_ready(x)
          t = time.perf_counter()
          jax.block_until_ready(exe(x, rhs_, sizes))
          if r:   # the first is a warm-up
            runs.append((time.perf_counter() - t) / loops * 1e3)
        del lhs, x
        row.update(ms=round(statistics.median(runs), 4), min_ms=round(min(runs), 4), max_ms=round(max(runs), 4))
        prob["tilings"].append(row)
      timed = [t for t in prob["tilings"] if "ms" in t]
      if timed:
        best = min(timed, key=lambda t: t["ms"])
        model_row = next((t for t in timed if tuple(t["tiling"]) == now), None)
        prob["best"] = best
        prob["model_ms"] = model_row["ms"] if model_row else None
        print(f"tokens {tokens} {name} [{m}, {k}] x [{k}, {n}]: model {now} "
              f"{prob['model_ms']} ms; best {tuple(best['tiling'])} {best['ms']} ms "
              f"(MXU floor {prob['mxu_floor_ms']:.3f}, HBM floor {prob['hbm_floor_ms']:.3f}); "
              f"{len(timed)} of {len(prob['tilings'])} timed", flush=True)
      result["problems"].append(prob)
      write()
  result["seconds"] = round(time.perf_counter() - t_start, 1)
  write()
  print(f"wrote {args.json}", flush=True)
  if not any("ms" in t for prob in result["problems"] for t in prob["tilings"]):
    print("error: no tiling was timed (every one failed or was skipped: the JSON has each reason)",
          file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
