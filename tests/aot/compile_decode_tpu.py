"""Child script: compiles one `kda_decode_step` ahead of time for a TPU topology and prints one JSON
line with the compiled executable's `memory_analysis()` figures.

Run in a libtpu compile venv by `tests/aot/test_tpu_decode_compile.py` through `AotRunner`, one
compile per process. The step is compiled as a server calls it: its own jit, the state donated
(`donate_argnums`), bfloat16 q, k, v, beta, float32 g (the activated decay) and float32 state
`[B, H, K, V]`, traced under `jax.sharding.use_abstract_mesh` of a one-chip mesh with
`jax.ShapeDtypeStruct` arguments (nothing is allocated). `--dtype float32` makes q, k, v, beta float32.

Usage: python -m tests.aot.compile_decode_tpu --chip v5e --batch 128 --heads 24
  [--key-dim 128 --value-dim 128 --implementation auto|pallas_tpu|xla]

Output (last stdout line): {"chip", "jax", "implementation", "argument_bytes", "output_bytes",
"temp_bytes", "alias_bytes", "kernels" (Mosaic custom calls in the compiled program), "compile_s"};
with --bench-loop also "state_in_vmem" (any [B, H, K, V] f32 buffer in memory space 1) and
"state_copies" (copy ops of that shape).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

TOPOLOGIES = {"v5e": "v5e:1x1", "v5e-2x2": "v5e:2x2", "v6e": "v6e:1x1", "tpu7x": "tpu7x:2x2x1"}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--chip", choices=sorted(TOPOLOGIES), required=True)
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--heads", type=int, default=24)
  ap.add_argument("--key-dim", type=int, default=128)
  ap.add_argument("--value-dim", type=int, default=128)
  ap.add_argument("--implementation", choices=["auto", "pallas_tpu", "xla"], default="auto")
  ap.add_argument("--bench-loop", action="store_true",
                  help="compile tools.bench.kernel_device_time's decode loop instead, and report whether "
                       "its state is placed in VMEM and how many state-sized copies it makes")
  ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="q, k, v, beta")
  args = ap.parse_args(argv)

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

  from kda_plugin.ops.decode import kda_decode_step  # noqa: PLC0415

  b, h, kd, vd = args.batch, args.heads, args.key_dim, args.value_dim
  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[args.chip], platform="tpu")
  mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
  sharding = NamedSharding(mesh, PartitionSpec())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  bf16, f32 = jnp.dtype(args.dtype), jnp.float32
  arrays = [sds((b, h, kd), bf16), sds((b, h, kd), bf16), sds((b, h, vd), bf16), sds((b, h, kd), f32),
            sds((b, h), bf16), sds((b, h, kd, vd), f32)]

  def step(q, k, v, g, beta, state):
    return kda_decode_step(q, k, v, g, beta, state, implementation=args.implementation)

  start = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    if args.bench_loop:
      from tools.bench.kernel_device_time import compile_decode_loop, decode_case  # noqa: PLC0415
      fn = decode_case(b, h, kd, vd, implementation=args.implementation)[0]
      compiled = compile_decode_loop(fn, arrays[5])
    else:
      compiled = jax.jit(step, donate_argnums=(5,)).lower(*arrays).compile()
  compile_s = time.perf_counter() - start
  ma = compiled.memory_analysis()
  text = compiled.as_text()
  report = dict(chip=args.chip, jax=jax.__version__, implementation=args.implementation,
                argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
                temp_bytes=int(ma.temp_size_in_bytes), alias_bytes=int(ma.alias_size_in_bytes),
                kernels=text.count('custom_call_target="tpu_custom_call"'), compile_s=round(compile_s, 2))
  if args.bench_loop:
    state = re.escape(f"f32[{b},{h},{kd},{vd}]")
    report["state_in_vmem"] = bool(re.search(state + r"\{[^}]*S\(1\)", text))
    report["state_copies"] = len(re.findall(state + r"\{[^}]*\} copy\(", text))
  print(json.dumps(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
