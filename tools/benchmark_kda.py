"""Benchmark KDA forwards against tokamax 0.0.17 (and fla on GPU) in one process.

Seed case (issue acceptance): B=1, H=8, K=V=128, T in {512, 8192}, float32 and bfloat16, two packed
documents split at T/2 - 17 (not 64-aligned), bounded gate (lower_bound=-5, a_log=0, dt_bias=-2)
activated inside each op, q/k L2-normalised inside each op, final states requested. Every backend
gets the same raw inputs; each call is jitted, warmed up, then timed `--runs` times with
`block_until_ready`. Runs are interleaved (round r calls every backend, in an order rotated by r, once
untimed and once timed) so that a slow spell of a shared machine hits all backends alike while every
timed call follows a call of its own op; the median latency, the process CPU time of the same runs,
and the speed-up against each peer (the median over rounds of the paired ratio) are reported.

Backends by platform (the others are listed as skipped, with the reason):
  any:  kda_chunked (training op), kda_inference_xla (kda_native's XLA backend, the CPU default),
        tokamax_xla_chunked (peer)
  TPU:  kda_inference_pallas_tpu (kda_native's Mosaic kernel), tokamax_mosaic (peer)
  GPU:  kda_inference_pallas_gpu (kda_native's Triton kernel), fla_chunk_kda (peer; needs torch + fla)

    .venv/bin/python tools/benchmark_kda.py                       # the seed table, writes benchmark_kda.json
    .venv/bin/python tools/benchmark_kda.py --seq-lens 512 --dtypes float32 --runs 5

Adding a backend: write `make(case) -> (fn, args)` returning a function whose first output is
`o [B, T, H, V]` (batch-first; convert inside the function if the op is head-first) and register it
with `register_backend` (`peer=True` for an external baseline). An `available()` callable returning a
reason string skips the backend cleanly on platforms that cannot run it. The estimated peak memory
column comes from XLA's `memory_analysis()` of the compiled call unless the backend supplies its own
`peak_memory(case)` (`kda_plugin.ops.inference.estimate_peak_memory` for the Pallas kernels).
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
  # Converts the first output to a NumPy array (default np.asarray; torch backends override it).
  to_numpy: Callable[[Any], np.ndarray] = lambda o: np.asarray(o, np.float32)


OUR_BACKENDS: dict[str, Backend] = {}
PEER_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend, *, peer: bool = False) -> None:
  (PEER_BACKENDS if peer else OUR_BACKENDS)[backend.name] = backend


# ----------------------------------------------------------------------------- our backends


def _make_chunked(case: Case):
  from kda_plugin.ops.chunked import kda_chunked  # built only when this backend is selected (start-up cost)
  from kda_plugin.ops.gates import kda_gate_bounded, l2norm  # built only when this backend is selected (start-up cost)

  @jax.jit
  def fn(q, k, v, g, beta, seg, a_log, dt_bias):
    # The training op takes an activated gate and normalised q, k: compose them in the same jit.
    g = kda_gate_bounded(g, a_log, dt_bias, lower_bound=LOWER_BOUND)
    return kda_chunked(l2norm(q), l2norm(k), v, g, beta, segment_ids=seg, max_num_segments=2,
                       output_final_state=True)

  a = case.arrays()
  return fn, (a["q"], a["k"], a["v"], a["g"], a["beta"], a["segment_ids"], a["a_log"], a["dt_bias"])


def _make_inference_xla(case: Case):
  from kda_plugin.ops.inference_xla import kda_inference_xla  # built only when this backend is selected (start-up cost)

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


def _make_inference_pallas(backend: str):
  def make(case: Case):
    from kda_plugin.ops.inference import kda_inference  # built only when this backend is selected (start-up cost)

    @jax.jit
    def fn(q, k, v, g, beta, seg, a_log, dt_bias):
      return kda_inference(q, k, v, g, beta, segment_ids=seg, max_num_segments=2, a_log=a_log,
                           dt_bias=dt_bias, lower_bound=LOWER_BOUND, use_qk_l2norm=True,
                           output_final_state=True, implementation=backend)

    a = case.arrays()
    return fn, (a["q"], a["k"], a["v"], a["g"], a["beta"], a["segment_ids"], a["a_log"], a["dt_bias"])
  return make


def _pallas_peak(backend: str):
  def peak(case: Case) -> int:
    from kda_plugin.ops.inference import estimate_peak_memory  # built only when this backend is selected (start-up cost)
    a = case.arrays()
    return estimate_peak_memory(a["q"], a["k"], a["v"], a["g"], a["beta"], segment_ids=a["segment_ids"],
                                max_num_segments=2, a_log=a["a_log"], dt_bias=a["dt_bias"],
                                output_final_state=True, implementation=backend)
  return peak


def _needs_platform(platform: str) -> Callable[[], str | None]:
  return lambda: None if jax.default_backend() == platform else f"needs a {platform.upper()} (this is {jax.default_backend()})"


# The kda_native kernels on their own platforms (the numerics of both are tested in interpret mode on CPU).
register_backend(Backend("kda_inference_pallas_tpu", _make_inference_pallas("pallas_tpu"),
                         available=_needs_platform("tpu"), peak_memory=_pallas_peak("pallas_tpu"),
                         note="Mosaic megakernel, gate and l2norm in-kernel"))
register_backend(Backend("kda_inference_pallas_gpu", _make_inference_pallas("pallas_gpu"),
                         available=_needs_platform("gpu"), peak_memory=_pallas_peak("pallas_gpu"),
                         note="Pallas GPU (Triton) megakernel, gate and l2norm in-kernel"))


# ----------------------------------------------------------------------------- peer (tokamax)


def _tokamax_available() -> str | None:
  try:
    import tokamax  # noqa: F401
  except ImportError as e:  # pragma: no cover - depends on the environment
    return f"tokamax not importable ({e})"
  return None


def _make_tokamax(case: Case, implementation: str = "xla_chunked"):
  from tokamax._src.ops.kda.api import kimi_delta_attention  # optional peer, imported only when its backend is selected

  @jax.jit
  def fn(q, k, v, g, beta, seg, a_log, dt_bias):
    o, final = kimi_delta_attention(q, k, v, g, beta, a_log=a_log, delta_time_bias=dt_bias,
                                    use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
                                    use_qk_l2norm=True, segment_ids=seg, max_num_segments=2,
                                    output_final_state=True, implementation=implementation)
    return jnp.moveaxis(o, 0, 2), final                                  # [H,B,T,V] -> [B,T,H,V]

  a = case.arrays()
  hf = lambda x: jnp.moveaxis(x, 2, 0)                                   # head-first, outside the timing
  return fn, (hf(a["q"]), hf(a["k"]), hf(a["v"]), hf(a["g"]), jnp.moveaxis(a["beta"], 2, 0),
              a["segment_ids"], a["a_log"], a["dt_bias"])


register_backend(Backend(PEER, _make_tokamax, available=_tokamax_available,
                         note="tokamax 0.0.17 kimi_delta_attention(implementation='xla_chunked'), "
                              "head-first inputs prepared outside the timing"), peer=True)
register_backend(Backend("tokamax_mosaic", lambda case: _make_tokamax(case, "mosaic"),
                         available=lambda: _needs_platform("tpu")() or _tokamax_available(),
                         note="tokamax 0.0.17 kimi_delta_attention(implementation='mosaic') (TPU)"),
                 peer=True)


def _fla_available() -> str | None:
  if jax.default_backend() != "gpu":
    return f"needs a GPU (this is {jax.default_backend()})"
  try:
    import torch  # noqa: F401
    from fla.ops.kda import chunk_kda  # noqa: F401
  except ImportError as e:  # pragma: no cover - depends on the environment
    return f"torch + fla not importable ({e})"
  return None


def _make_fla(case: Case):
  """fla's `chunk_kda` on the same inputs: varlen (cu_seqlens) for the two documents of the row, the
  bounded gate in-kernel (`safe_gate=True, lower_bound`), q/k L2 norm in-kernel, final states."""
  import torch  # optional peer, imported only when its backend is selected
  from fla.ops.kda import chunk_kda  # optional peer, imported only when its backend is selected

  if case.batch != 1:
    raise ValueError("the fla baseline packs documents with cu_seqlens and needs --batch 1")
  a = case.arrays()
  dev = torch.device("cuda")
  tt = lambda x, dt=None: torch.from_numpy(np.asarray(x, np.float32)).to(dev, dt or getattr(torch, case.dtype))
  q, k, v, g = (tt(a[n]) for n in ("q", "k", "v", "g"))
  beta = tt(a["beta"])
  a_log, dt_bias = tt(a["a_log"], torch.float32), tt(a["dt_bias"], torch.float32)
  split = int(np.sum(np.asarray(a["segment_ids"])[0] == 1))
  cu = torch.tensor([0, split, case.seq_len], dtype=torch.long, device=dev)

  def fn(*_):
    with torch.inference_mode():
      o, final = chunk_kda(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                           safe_gate=True, lower_bound=LOWER_BOUND, use_qk_l2norm_in_kernel=True,
                           output_final_state=True, cu_seqlens=cu)
    torch.cuda.synchronize()
    return o, final

  return fn, ()


register_backend(Backend("fla_chunk_kda", _make_fla, available=_fla_available,
                         note="fla chunk_kda (Triton), cu_seqlens packing, gate and l2norm in-kernel",
                         to_numpy=lambda o: o.float().cpu().numpy()), peer=True)


# ----------------------------------------------------------------------------- measurement


def _xla_peak_bytes(fn, args) -> int | None:
  try:
    ma = fn.lower(*args).compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)
  except Exception:  # noqa: BLE001 - not every backend/platform reports it
    return None


def measure_case(backends: list[Backend], case: Case, *, runs: int, warmup: int,
                 failed: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
  """Times every backend on one case, interleaved: round r calls each backend (in an order rotated by
  r) twice, untimed then timed, so a slow spell of a shared machine hits all of them alike while each
  timed call follows a call of its own op. Ratios against a peer are the median over rounds of the
  per-round ratio (paired), not the ratio of two medians taken minutes apart. A backend whose build
  or first call raises is left out of the case and its error recorded in `failed` (printed with the
  table: on a device the kernels and peers have not run on before, one failure must not hide the
  other figures)."""
  made = {}
  for be in backends:
    print(f"T={case.seq_len} {case.dtype} {be.name}: compiling ...", file=sys.stderr, flush=True)
    try:
      fn, args = be.make(case)
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
      if failed is None:
        raise
      failed[f"{be.name} (T={case.seq_len} {case.dtype})"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      print(f"  failed: {failed[list(failed)[-1]]}", file=sys.stderr, flush=True)
      continue
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
    made[be.name] = (be, fn, args, out, first_s)
  names = list(made)
  times = {n: [] for n in names}
  cpu = {n: [] for n in names}
  for r in range(runs):
    for i in range(len(names)):
      n = names[(i + r) % len(names)]
      _, fn, args, _, _ = made[n]
      # One untimed call first: the timed call then finds the allocator, caches and thread pool in
      # the state its own op leaves (as in a model step), not the state of the previous peer, whose
      # frees of hundreds of MB otherwise cost the next op its page faults.
      jax.block_until_ready(fn(*args))
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      times[n].append(time.perf_counter() - t0)
      cpu[n].append(time.process_time() - c0)
  results = {}
  for n, (be, fn, args, out, first_s) in made.items():
    peak = be.peak_memory(case) if be.peak_memory else _xla_peak_bytes(fn, args)
    results[n] = dict(backend=n, seq_len=case.seq_len, dtype=case.dtype, runs=runs,
                      median_ms=1e3 * statistics.median(times[n]), min_ms=1e3 * min(times[n]),
                      cpu_median_ms=1e3 * statistics.median(cpu[n]), first_call_s=first_s,
                      peak_bytes=peak, output=be.to_numpy(out[0]), times_ms=[1e3 * x for x in times[n]])
  for n, r in results.items():
    if n in PEER_BACKENDS:
      continue
    r["speedup_vs"] = {p: statistics.median(a / b for a, b in zip(times[p], times[n]))
                       for p in results if p in PEER_BACKENDS}
    r["cpu_speedup_vs"] = {p: statistics.median(a / b for a, b in zip(cpu[p], cpu[n]))
                           for p in results if p in PEER_BACKENDS}
  return results


def _markdown(rows: list[dict[str, Any]]) -> str:
  head = ("| T | dtype | backend | median ms | min ms | CPU-time ms | tokamax xla_chunked / this | "
          "same, CPU time | other peers / this | est. peak MB | max abs diff vs kda_inference_xla |")
  lines = [head, "|" + "---|" * 11]
  for r in rows:
    sv, cv = r.get("speedup_vs") or {}, r.get("cpu_speedup_vs") or {}
    sp = f"{sv[PEER]:.2f}x" if PEER in sv else "-"
    csp = f"{cv[PEER]:.2f}x" if PEER in cv else "-"
    other = ", ".join(f"{p} {x:.2f}x" for p, x in sv.items() if p != PEER) or "-"
    mb = f"{r['peak_bytes'] / 2**20:.1f}" if r.get("peak_bytes") else "-"
    diff = "-" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2e}"
    lines.append(f"| {r['seq_len']} | {r['dtype']} | {r['backend']} | {r['median_ms']:.2f} | "
                 f"{r['min_ms']:.2f} | {r['cpu_median_ms']:.1f} | {sp} | {csp} | {other} | {mb} | {diff} |")
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
  ap.add_argument("--output", default="benchmark_kda.json",
                  help="JSON results path, replaced if it exists (written atomically at the end; its directory "
                       "must exist) (default %(default)s)")
  args = ap.parse_args(argv)
  if args.runs < 5:
    ap.error("--runs must be at least 5")
  for flag, values, least in (("--seq-lens", args.seq_lens, 1), ("--batch", [args.batch], 1),
                              ("--heads", [args.heads], 1), ("--key-dim", [args.key_dim], 1),
                              ("--value-dim", [args.value_dim], 1), ("--warmup", [args.warmup], 0)):
    bad = [x for x in values if x < least]
    if bad:
      ap.error(f"{flag} must be at least {least}, got {bad[0]}")
  out_dir = os.path.dirname(os.path.abspath(args.output))
  if os.path.isdir(args.output):
    ap.error(f"--output {args.output} is a directory; expected a file path")
  if not os.path.isdir(out_dir):
    ap.error(f"--output {args.output}: directory {out_dir} does not exist")

  table = {**OUR_BACKENDS, **PEER_BACKENDS}
  names = args.backends or list(table)
  unknown = [n for n in names if n not in table]
  if unknown:
    ap.error(f"unknown backend(s) {unknown}; choose from {sorted(table)}")
  runnable_names = [n for n in names if not table[n].available()]
  if not runnable_names:
    ap.error("nothing to run here: " + "; ".join(f"{n}: {table[n].available()}" for n in names))
  rows, skipped, failed = [], {}, {}
  for t in args.seq_lens:
    for dt in args.dtypes:
      case = Case(args.batch, t, args.heads, args.key_dim, args.value_dim, dt)
      runnable = []
      for name in names:
        reason = table[name].available()
        if reason:
          skipped[name] = reason
        else:
          runnable.append(table[name])
      results = measure_case(runnable, case, runs=args.runs, warmup=args.warmup, failed=failed)
      ref = results.get("kda_inference_xla")
      for name, r in results.items():
        r["max_abs_diff"] = (float(np.max(np.abs(r["output"] - ref["output"])))
                             if ref is not None and name != "kda_inference_xla" else None)
      for r in results.values():
        del r["output"]
        rows.append(r)

  print(_markdown(rows))
  for name, reason in skipped.items():
    print(f"skipped {name}: {reason}")
  for name, reason in failed.items():
    print(f"FAILED {name}: {reason}")
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), jax=jax.__version__,
              backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
              cpu_count=os.cpu_count(), python=platform.python_version(),
              case=dict(batch=args.batch, heads=args.heads, key_dim=args.key_dim,
                        value_dim=args.value_dim, documents="2, split at T/2-17",
                        gate=dict(a_log=A_LOG, dt_bias=DT_BIAS, lower_bound=LOWER_BOUND),
                        use_qk_l2norm=True),
              runs=args.runs, warmup=args.warmup,
              notes={n: table[n].note for n in names if n in table})
  tmp = f"{args.output}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(dict(meta=meta, results=rows, skipped=skipped, failed=failed), f, indent=2)
  os.replace(tmp, args.output)
  print(f"wrote {args.output}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
