"""Child script: compiles one `kda_inference(implementation="pallas_tpu")` call ahead of time for a TPU
topology and prints one JSON line with the compiled executable's `memory_analysis()` figures.

Run in the libtpu compile venv (`.venv-tpu-aot`) by `tests/aot/test_tpu_kernel_compile.py` through
`AotRunner`, one compile per process: a Mosaic CHECK failure aborts the process, and libtpu holds a
lock file. The call is traced under `jax.sharding.use_abstract_mesh` of a one-chip mesh of the
topology's devices, with `jax.ShapeDtypeStruct` arguments (nothing is allocated).

The compiled case (defaults: the seed shape of issue 12): q, k, g `[B, T, H*K]` and v `[B, T, H*V]`
in the lane-dense layout the model's projections produce, beta `[B, T, H]`, a shared `[T]` segment
map with `--docs` documents of equal length except that the first ends 17 tokens before its share
(the seed's split at T/2 - 17 for two documents), the in-kernel gate (`--gate softplus|bounded`),
q/k L2 norm inside the kernel, final states, optional initial states (`--h0`).

With `--train IMPL`, the training op instead: the value and the gradients of q, k, v, g, beta and the
gate's a_log, dt_bias of `kda_chunked(implementation=IMPL)` (no final states), IMPL "pallas_tpu" (the
kernel's forward and backward) or "xla" (the chunk scan and its autodiff); the report
then adds "kernel_calls" (the Mosaic custom calls in the compiled HLO) and "flops" (XLA's count).

Usage: python -m tests.aot.compile_kda_tpu --chip tpu7x --dtype bfloat16 --gate bounded [--h0]
  [--batch 1 --seq-len 8192 --heads 8 --key-dim 128 --value-dim 128 --docs 2 --num-segments N]
  [--train pallas_tpu|xla]

Output (last stdout line): {"chip", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
"generated_code_bytes", "estimate_bytes", "compile_s"}; or {"chip", "value_error", "seconds"} when
kda_inference refuses the call while tracing (e.g. buffers larger than the device's HBM).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

# v5e-2x2: libtpu 0.0.42 (pinned by jax[tpu]==0.10.2) takes no v5e topology below one 2x2 host; the
# kernel is compiled for one of its chips all the same.
TOPOLOGIES = {"v5e": "v5e:1x1", "v5e-2x2": "v5e:2x2", "v6e": "v6e:1x1", "tpu7x": "tpu7x:2x2x1"}


def _segment_map(t: int, docs: int):
  import numpy as np  # noqa: PLC0415
  seg = np.zeros(t, np.int32)
  bounds = [round(i * t / docs) for i in range(docs + 1)]
  if docs > 1:
    bounds[1] -= 17
  for i in range(docs):
    seg[bounds[i]:bounds[i + 1]] = i + 1
  return seg


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--chip", choices=sorted(TOPOLOGIES), required=True)
  ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  ap.add_argument("--gate", choices=["softplus", "bounded", "pre_activated"], default="bounded",
                  help="in-kernel gate family, or pre_activated (g is the log-space decay)")
  ap.add_argument("--no-final", action="store_true", help="do not request the final states")
  ap.add_argument("--h0", action="store_true", help="pass per-slot initial states")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq-len", type=int, default=8192)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--key-dim", type=int, default=128)
  ap.add_argument("--value-dim", type=int, default=128)
  ap.add_argument("--docs", type=int, default=2)
  ap.add_argument("--num-segments", type=int, default=None, help="state slots N (default: --docs)")
  ap.add_argument("--matmul-precision", default=None,
                  help="trace under jax.default_matmul_precision(VALUE), as a caller may (e.g. highest)")
  ap.add_argument("--layout", choices=["lane_dense", "heads"], default="lane_dense",
                  help="q, k, v, g as lane-dense [B, T, H*D] (num_heads given) or head-major [B, T, H, D]")
  ap.add_argument("--train", choices=["pallas_tpu", "xla"], default=None,
                  help="compile the training op's value and gradients with this implementation")
  args = ap.parse_args(argv)

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

  from kda_plugin.ops.chunked import kda_chunked  # noqa: PLC0415
  from kda_plugin.ops.inference import estimate_peak_memory, kda_inference  # noqa: PLC0415

  b, t, h, kd, vd = args.batch, args.seq_len, args.heads, args.key_dim, args.value_dim
  n = args.num_segments or args.docs
  dtype = jnp.dtype(args.dtype)
  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[args.chip], platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  sharding = NamedSharding(mesh, PartitionSpec())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  seg_values = _segment_map(t, args.docs)
  lower_bound = -5.0 if args.gate == "bounded" else None
  heads = args.layout == "heads"
  qk = (b, t, h, kd) if heads else (b, t, h * kd)
  vshape = (b, t, h, vd) if heads else (b, t, h * vd)
  arrays = [sds(qk, dtype), sds(qk, dtype), sds(vshape, dtype), sds(qk, dtype), sds((b, t, h), dtype),
            sds((t,), jnp.int32), sds((h,), jnp.float32), sds((h * kd,), jnp.float32)]
  gate = args.gate != "pre_activated"
  want_final = not args.no_final
  if args.h0:
    arrays.append(sds((b, n, h, kd, vd), jnp.float32))

  if not gate:
    arrays[3] = sds(qk, jnp.float32)  # the activated decay, float32 as the model makes it

  def f(q, k, v, g, beta, seg, a_log, dt_bias, *h0):
    gate_kw = dict(a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound) if gate else {}
    return kda_inference(q, k, v, g, beta, segment_ids=seg, initial_state=h0[0] if h0 else None,
                         output_final_state=want_final, max_num_segments=n, use_qk_l2norm=True,
                         num_heads=None if heads else h, implementation="pallas_tpu", **gate_kw)

  if args.train:
    if args.h0 or not gate:
      ap.error("--train compiles the model's training call: the in-op gate, no --h0")
    wo = sds(vshape, jnp.float32)

    def loss(q, k, v, g, beta, a_log, dt_bias, seg, wo):
      o, _ = kda_chunked(q, k, v, g, beta, segment_ids=seg, max_num_segments=n, a_log=a_log,
                         dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=True,
                         num_heads=None if heads else h, implementation=args.train)
      return jnp.sum(o.astype(jnp.float32) * wo)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6))
    start = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      compiled = jax.jit(grad).lower(*arrays[:5], arrays[6], arrays[7], arrays[5], wo).compile()
    ma = compiled.memory_analysis()
    hlo = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(json.dumps(dict(chip=args.chip, train=args.train, argument_bytes=int(ma.argument_size_in_bytes),
                          output_bytes=int(ma.output_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes),
                          generated_code_bytes=int(ma.generated_code_size_in_bytes),
                          kernel_calls=hlo.count('custom_call_target="tpu_custom_call"'),
                          flops=float((cost or {}).get("flops", -1)),
                          compile_s=round(time.perf_counter() - start, 2))))
    return 0

  start = time.perf_counter()
  precision = (jax.default_matmul_precision(args.matmul_precision) if args.matmul_precision
               else contextlib.nullcontext())
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), precision:
    try:
      lowered = jax.jit(f).lower(*arrays)
    except ValueError as e:  # refused while tracing, before anything reaches the compiler
      print(json.dumps(dict(chip=args.chip, value_error=str(e), seconds=round(time.perf_counter() - start, 2))))
      return 0
    compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  ma = compiled.memory_analysis()
  estimate = estimate_peak_memory(
      *arrays[:5], segment_ids=arrays[5], initial_state=arrays[8] if args.h0 else None,
      output_final_state=want_final, max_num_segments=n, a_log=arrays[6] if gate else None,
      dt_bias=arrays[7] if gate else None, num_heads=None if heads else h, implementation="pallas_tpu")
  report = dict(chip=args.chip, argument_bytes=int(ma.argument_size_in_bytes),
                output_bytes=int(ma.output_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes),
                alias_bytes=int(ma.alias_size_in_bytes),
                generated_code_bytes=int(ma.generated_code_size_in_bytes),
                estimate_bytes=int(estimate), compile_s=round(compile_s, 2))
  print(json.dumps(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
