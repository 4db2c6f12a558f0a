"""Benchmark KDA forwards against tokamax 0.0.17 `xla_chunked` in one process.

Seed case (issue acceptance): B=1, H=8, K=V=128, T in {512, 8192}, float32 and bfloat16, two packed
documents split at T/2 - 17 (not 64-aligned), bounded gate (lower_bound=-5, a_log=0, dt_bias=-2)
activated inside each op, q/k L2-normalised inside each op. Every backend gets the same raw inputs;
each call is jitted, warmed up, then timed `--runs` times with `block_until_ready` (median reported;
the process CPU time of the same runs is reported too, a steadier measure on a shared machine).

    .venv/bin/python tools/benchmark_kda.py                       # the seed table, writes benchmark_kda.json
    .venv/bin/python tools/benchmark_kda.py --seq-lens 512 --dtypes float32 --runs 5

Adding a backend: write `make(case) -> (jitted_fn, args)` returning a function whose first output is
`o [B, T, H, V]` (batch-first; convert inside the function if the op is head-first) and register it
with `register_backend` in `OUR_BACKENDS` (or `PEER_BACKENDS` for an external baseline). An
`available()` callable returning a reason string skips the backend cleanly on platforms that cannot run
it (the Pallas TPU/GPU and fla backends of `kda_inference` plug in here). The estimated peak memory
column comes from XLA's `memory_analysis()` of the compiled call unless the backend supplies its own
`peak_memory(case)` (e.g. `kda_plugin.ops.inference.estimate_peak_memory` for the Pallas kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

A_LOG, DT_BIAS, LOWER_BOUND = 0.0, -2.0, -5.0
PEER = "tokamax_xla_chunked"


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark problem: raw batch-first inputs (q, k un-normalised; g the raw gate input)."""

  batch: int
  seq_len: int
  heads: int
  key_dim: int
  value_dim: int
  dtype: str
  seed: int = 0

  def arrays(self) -> dict[str, Any]:
    b, t, h, kd, vd = self.batch, self.seq_len, self.heads, self.key_dim, self.value_dim
    ks = jax.random.split(jax.random.PRNGKey(self.seed), 5)
    dt = jnp.dtype(self.dtype)
    split = t // 2 - 17
    seg = jnp.concatenate([jnp.ones((b, split), jnp.int32), jnp.full((b, t - split), 2, jnp.int32)], 1)
    return dict(
        q=jax.random.normal(ks[0], (b, t, h, kd)).astype(dt),
        k=jax.random.normal(ks[1], (b, t, h, kd)).astype(dt),
        v=jax.random.normal(ks[2], (b, t, h, vd)).astype(dt),
        g=jax.random.normal(ks[3], (b, t, h, kd)).astype(dt),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))).astype(dt),
        segment_ids=seg,
        a_log=jnp.full((h,), A_LOG, jnp.float32),
        dt_bias=jnp.full((h * kd,), DT_BIAS, jnp.float32),
    )


@dataclasses.dataclass(frozen=True)
class Backend:
  """A benchmarked forward. `make(case)` returns `(jitted_fn, args)`; `fn(*args)[0]` is o [B,T,H,V]."""

  name: str
  make: Callable[[Case], tuple[Callable, tuple]]
  available: Callable[[], str | None] = lambda: None
  peak_memory: Callable[[Case], int | None] | None = None
  note: str = ""


OUR_BACKENDS: dict[str, Backend] = {}
PEER_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend, *, peer: bool = False) -> None:
  (PEER_BACKENDS if peer else OUR_BACKENDS)[backend.name] = backend


# ----------------------------------------------------------------------------- our backends


def _make_chunked(case: Case):
  from kda_plugin.ops.chunked import kda_chunked
  from kda_plugin.ops.gates import kda_gate_bounded, l2norm

  @jax.jit
  def fn(q, k, v, g, beta, seg, a_log, dt_bias):
    # The training op takes an activated gate and normalised q, k: compose them in the same jit.
    g = kda_gate_bounded(g, a_log, dt_bias, lower_bound=LOWER_BOUND)
    return kda_chunked(l2norm(q), l2norm(k), v, g, beta, segment_ids=seg, max_num_segments=2,
                       output_final_state=True)

  a = case.arrays()
  return fn, (a["q"], a["k"], a["v"], a["g"], a["beta"], a["segment_ids"], a["a_log"], a["dt_bias"])


def _make_inference_xla(case: Case):
  from kda_plugin.ops.inference_xla import kda_inference_xla

  @jax.jit
  def fn(q, k, v, g, beta, seg, a_log, dt_bias):
    return kda_inference_xla(q, k, v, g, beta, segment_ids=seg, max_num_segments=2, a_log=a_log,
                             dt_bias=dt_bias, lower_bound=LOWER_BOUND, use_qk_l2norm=True,
                             output_final_state=True)

  a = case.arrays()
  return fn, (a["q"], a["k"], a["v"], a["g"], a["beta"], a["segment_ids"], a["a_log"], a["dt_bias"])


register_backend(Backend("kda_chunked", _make_chunked,
                         note="training op; gate and l2norm composed in the same jit"))
register_backend(Backend("kda_inference_xla", _make_inference_xla,
                         note="gate and l2norm in-kernel"))
# Hook for the megakernel backends of `kda_plugin.ops.inference.kda_inference`, e.g.:
#   register_backend(Backend("kda_inference_pallas_tpu", make=..., available=lambda: None if
#                    jax.default_backend() == "tpu" else "needs a TPU", peak_memory=...))
# and likewise "kda_inference_pallas_gpu" and an "fla" (GPU) baseline.


# ----------------------------------------------------------------------------- peer (tokamax)


def _tokamax_available() -> str | None:
  try:
    import tokamax  # noqa: F401
  except ImportError as e:  # pragma: no cover - depends on the environment
    return f"tokamax not importable ({e})"
  return None


def _make_tokamax(case: Case):
  from tokamax._src.ops.kda.api import kimi_delta_attention

  @jax.jit
  def fn(q, k, v, g, beta, seg, a_log, dt_bias):
    o, final = kimi_delta_attention(q, k, v, g, beta, a_log=a_log, delta_time_bias=dt_bias,
                                    use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
                                    use_qk_l2norm=True, segment_ids=seg, max_num_segments=2,
                                    output_final_state=True, implementation="xla_chunked")
    return jnp.moveaxis(o, 0, 2), final                                  # [H,B,T,V] -> [B,T,H,V]

  a = case.arrays()
  hf = lambda x: jnp.moveaxis(x, 2, 0)                                   # head-first, outside the timing
  return fn, (hf(a["q"]), hf(a["k"]), hf(a["v"]), hf(a["g"]), jnp.moveaxis(a["beta"], 2, 0),
              a["segment_ids"], a["a_log"], a["dt_bias"])


register_backend(Backend(PEER, _make_tokamax, available=_tokamax_available,
                         note="tokamax 0.0.17 kimi_delta_attention(implementation='xla_chunked'), "
                              "head-first inputs prepared outside the timing"), peer=True)


# ----------------------------------------------------------------------------- measurement


def _xla_peak_bytes(fn, args) -> int | None:
  try:
    ma = fn.lower(*args).compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)
  except Exception:  # noqa: BLE001 - not every backend/platform reports it
    return None


def time_backend(backend: Backend, case: Case, *, runs: int, warmup: int) -> dict[str, Any]:
  fn, args = backend.make(case)
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times, cpu = [], []
  for _ in range(runs):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  peak = backend.peak_memory(case) if backend.peak_memory else _xla_peak_bytes(fn, args)
  return dict(backend=backend.name, seq_len=case.seq_len, dtype=case.dtype,
              median_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times), runs=runs,
              cpu_median_ms=1e3 * statistics.median(cpu),
              first_call_s=compile_s, peak_bytes=peak, output=np.asarray(out[0], np.float32))


def _markdown(rows: list[dict[str, Any]]) -> str:
  head = ("| T | dtype | backend | median ms | min ms | tokamax / this | CPU-time ms | "
          "tokamax / this (CPU time) | est. peak MB | max abs diff vs kda_inference_xla |")
  lines = [head, "|" + "---|" * 10]
  for r in rows:
    sp = f"{r['speedup_vs_peer']:.2f}x" if r.get("speedup_vs_peer") else "-"
    csp = f"{r['cpu_speedup_vs_peer']:.2f}x" if r.get("cpu_speedup_vs_peer") else "-"
    mb = f"{r['peak_bytes'] / 2**20:.1f}" if r.get("peak_bytes") else "-"
    diff = "-" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2e}"
    lines.append(f"| {r['seq_len']} | {r['dtype']} | {r['backend']} | {r['median_ms']:.2f} | "
                 f"{r['min_ms']:.2f} | {sp} | {r['cpu_median_ms']:.1f} | {csp} | {mb} | {diff} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 8192], help="T values (default 512 8192)")
  ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                  help="input dtypes (default float32 bfloat16)")
  ap.add_argument("--batch", type=int, default=1, help="B (default 1)")
  ap.add_argument("--heads", type=int, default=8, help="H (default 8)")
  ap.add_argument("--key-dim", type=int, default=128, help="K (default 128)")
  ap.add_argument("--value-dim", type=int, default=128, help="V (default 128)")
  ap.add_argument("--runs", type=int, default=7, help="timed runs per backend, median reported (>= 5)")
  ap.add_argument("--warmup", type=int, default=2, help="untimed runs after the compiling call")
  ap.add_argument("--backends", nargs="+", default=None,
                  help=f"subset to run (default all): {sorted(OUR_BACKENDS) + sorted(PEER_BACKENDS)}")
  ap.add_argument("--output", default="benchmark_kda.json", help="JSON results path (default %(default)s)")
  args = ap.parse_args(argv)
  if args.runs < 5:
    ap.error("--runs must be at least 5")

  table = {**OUR_BACKENDS, **PEER_BACKENDS}
  names = args.backends or list(table)
  unknown = [n for n in names if n not in table]
  if unknown:
    ap.error(f"unknown backend(s) {unknown}; choose from {sorted(table)}")
  rows, skipped = [], {}
  for t in args.seq_lens:
    for dt in args.dtypes:
      case = Case(args.batch, t, args.heads, args.key_dim, args.value_dim, dt)
      results = {}
      for name in names:
        reason = table[name].available()
        if reason:
          skipped[name] = reason
          continue
        print(f"T={t} {dt} {name} ...", file=sys.stderr, flush=True)
        results[name] = time_backend(table[name], case, runs=args.runs, warmup=args.warmup)
      peer = results.get(PEER)
      ref = results.get("kda_inference_xla")
      for name, r in results.items():
        r["speedup_vs_peer"] = (peer["median_ms"] / r["median_ms"]) if peer and name != PEER else None
        r["cpu_speedup_vs_peer"] = ((peer["cpu_median_ms"] / r["cpu_median_ms"])
                                    if peer and name != PEER else None)
        r["max_abs_diff"] = (float(np.max(np.abs(r["output"] - ref["output"])))
                             if ref is not None and name != "kda_inference_xla" else None)
      for r in results.values():
        del r["output"]
        rows.append(r)

  print(_markdown(rows))
  for name, reason in skipped.items():
    print(f"skipped {name}: {reason}")
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), jax=jax.__version__,
              backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
              cpu_count=os.cpu_count(), python=platform.python_version(),
              case=dict(batch=args.batch, heads=args.heads, key_dim=args.key_dim,
                        value_dim=args.value_dim, documents="2, split at T/2-17",
                        gate=dict(a_log=A_LOG, dt_bias=DT_BIAS, lower_bound=LOWER_BOUND),
                        use_qk_l2norm=True),
              runs=args.runs, warmup=args.warmup,
              notes={n: table[n].note for n in names if n in table})
  with open(args.output, "w") as f:
    json.dump(dict(meta=meta, results=rows, skipped=skipped), f, indent=2)
  print(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
