r"""Where a KDA layer's prefill time goes on a device: one KDA mixer of a model config, timed whole and in pieces.

The mixer of `--config` (default the 0.9B test model, configs/kimi_linear_48b_pattern_0p9b.py;
random weights, bf16, the config's own gate: Kimi's softplus gate unless kda_gate_lower_bound is set)
runs on one `[1, T, hidden]` row. Each piece is its own jitted program (wall clock, blocked, median
of --repeats after a warm-up call; every program compiled before any is timed).

Pieces: the mixer as prefill runs it (16 document slots, caches returned), the mixer without caches
(1 slot), the q/k/v projections, the projections + short convs + gate and beta projections, the
kernel alone on precomputed inputs (16 slots with final states; 1 slot without), and the output
norm + gate + o_proj.

Usage: python -m tools.bench.kda_layer_split [--seq-len 8192] [--repeats 20] [--config NAME] [--json OUT.json]
Exit status: 0; 2 bad arguments (one `error:` line naming the argument).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m tools.bench.kda_layer_split", description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--seq-len", type=int, default=8192, help="tokens in the row, one document (>= 64)")
  ap.add_argument("--repeats", type=int, default=20, help="timed calls per piece (>= 1)")
  ap.add_argument("--config", default="kimi_linear_48b_pattern_0p9b",
                  help="model config: a name under configs/ or a .py/.json path")
  ap.add_argument("--json", default=None, help="also write the figures here (checked before any work)")
  args = ap.parse_args(argv)
  if args.seq_len < 64:
    ap.error(f"--seq-len must be >= 64, got {args.seq_len}")
  if args.repeats < 1:
    ap.error(f"--repeats must be >= 1, got {args.repeats}")
  from model.errors import UserError  # noqa: PLC0415
  from tools.cli import check_output_path, write_json_atomic  # noqa: PLC0415
  if args.json:
    try:
      check_output_path(args.json, "--json", overwrite=True)
    except UserError as e:
      ap.error(str(e))
  import jax  # noqa: PLC0415  (after argument parsing: --help needs no jax)
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  import kda_plugin  # noqa: F401,PLC0415  (registers kda_native)
  from model import registry  # noqa: PLC0415
  from model.config import ModelArgs, load_config  # noqa: PLC0415
  from model.nn.kda import KimiDeltaAttention  # noqa: PLC0415

  try:
    cfg = load_config([args.config, "dtype=bfloat16"])
  except UserError as e:
    ap.error(f"--config: {e}")
  margs = ModelArgs.from_config(cfg, validate=False)
  with nnx.use_eager_sharding(False):
    mixer = KimiDeltaAttention(margs, registry.get_backend(margs.attention), rngs=nnx.Rngs(0))
  gd, st = nnx.split(mixer)
  t = args.seq_len
  x = jax.random.normal(jax.random.key(1), (1, t, margs.hidden_size)).astype(jnp.bfloat16)
  seg = jnp.ones((1, t), jnp.int32)
  kd = margs.kda_head_dim
  m = lambda s: nnx.merge(gd, s)

  def whole(s, x, seg, slots, ret):
    return m(s)(x, segment_ids=seg, mode="prefill", num_slots=slots, return_cache=ret, cache_length=t)

  def inputs(s, x, seg):
    mm, be = m(s), m(s).backend
    qkv = [be.short_conv(p(x), c.kernel[...], segment_ids=seg, cache=None, max_num_segments=16)[0]
           for p, c in ((mm.q_proj, mm.q_conv1d), (mm.k_proj, mm.k_conv1d), (mm.v_proj, mm.v_conv1d))]
    return (*qkv, mm.f_b_proj(mm.f_a_proj(x)), jax.nn.sigmoid(mm.b_proj(x).astype(jnp.float32)))

  def projections(s, x, seg):
    mm = m(s)
    return mm.q_proj(x), mm.k_proj(x), mm.v_proj(x)

  def kernel(s, q, k, v, g, beta, seg, slots, ret):
    mm = m(s)
    return mm.backend.kda(q, k, v, g, beta, mode="prefill", segment_ids=seg, initial_state=None,
                          output_final_state=ret, max_num_segments=slots, implementation=mm.implementation,
                          num_heads=q.shape[-1] // kd, a_log=mm.A_log[...], dt_bias=mm.dt_bias[...],
                          lower_bound=mm.lower_bound)

  def output(s, o, x):
    return m(s)._output(o, x)

  pre = jax.jit(inputs)(st, x, seg)
  jax.block_until_ready(pre)
  o = jax.jit(lambda s, *a: kernel(s, *a, 1, False)[0])(st, *pre, seg)
  programs = {
      "mixer, 16 slots, caches (as prefill)": (lambda s, x, seg: whole(s, x, seg, 16, True), (st, x, seg)),
      "mixer, 1 slot, no cache": (lambda s, x, seg: whole(s, x, seg, 1, False), (st, x, seg)),
      "q/k/v projections": (projections, (st, x, seg)),
      "projections + short convs + gate + beta": (inputs, (st, x, seg)),
      "kernel, 16 slots, final states": (lambda s, *a: kernel(s, *a, 16, True), (st, *pre, seg)),
      "kernel, 1 slot, no final state": (lambda s, *a: kernel(s, *a, 1, False), (st, *pre, seg)),
      "output norm + gate + o_proj": (output, (st, o, x)),
  }
  t0 = time.perf_counter()
  compiled = {name: jax.jit(fn).lower(*a).compile() for name, (fn, a) in programs.items()}
  print(f"compiled {len(compiled)} programs in {time.perf_counter() - t0:.1f} s", flush=True)
  from tools.bench.e2e_device import timed  # noqa: PLC0415
  rows = {}
  for name, exe in compiled.items():
    a = programs[name][1]
    jax.block_until_ready(exe(*a))   # warm-up
    med, runs = timed(lambda: exe(*a), args.repeats)
    rows[name] = {"median_ms": round(med * 1e3, 4), "min_ms": round(min(runs) * 1e3, 4),
                  "max_ms": round(max(runs) * 1e3, 4)}
    print(f"{name:42s} {rows[name]['median_ms']:8.3f} ms [{rows[name]['min_ms']:.3f}, {rows[name]['max_ms']:.3f}]",
          flush=True)
  from tools.bench.kernel_device_time import _commit  # noqa: PLC0415
  lb = margs.kda_gate_lower_bound
  report = {"what": "tools/bench/kda_layer_split.py", "commit": _commit(), "config": args.config, "seq_len": t,
            "repeats": args.repeats, "dtype": "bfloat16", "attention": margs.attention,
            "kda_implementation": margs.kda_implementation, "backend": jax.default_backend(),
            "gate": "softplus (no lower bound)" if lb is None else f"bounded ({lb})",
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "pieces": rows}
  if args.json:
    write_json_atomic(args.json, report, "--json", overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
