"""Child script for tests/aot/test_tpu_cost.py: compiles a tiny hand-written Pallas TPU kernel whose
instruction counts can be derived by hand, then prints what `tools.tpu_llo` counts in its dump.

    python -m tests.aot.tpu_cost_tiny_kernel CHIP DUMP_DIR      (LIBTPU_INIT_ARGS must dump to DUMP_DIR)

The kernel, per grid step i of grid=(2,): y = x[i] @ w (bf16 [128, 256] @ bf16 [256, 256], float32
accumulation), then three times y = exp(y) in a fori_loop, o[i] = y (float32 [128, 256]).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tools import tpu_llo

TOPOLOGY = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:2x2x1"}
M, K, N, LOOP = 128, 256, 256, 3


def _kernel(x_ref, w_ref, o_ref):
  y = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  o_ref[...] = jax.lax.fori_loop(0, LOOP, lambda _, a: jnp.exp(a), y)


def tiny_cost_kernel(x, w):
  return pl.pallas_call(
      _kernel, out_shape=jax.ShapeDtypeStruct((2 * M, N), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((M, K), lambda i: (i, 0)), pl.BlockSpec((K, N), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((M, N), lambda i: (i, 0)))(x, w)


def main() -> int:
  chip, dump_dir = sys.argv[1], sys.argv[2]
  topo = topologies.get_topology_desc(topology_name=TOPOLOGY[chip], platform="tpu")
  mesh = Mesh(np.array(topo.devices[:1]), ("x",))
  sh = NamedSharding(mesh, PartitionSpec())
  args = (jax.ShapeDtypeStruct((2 * M, K), jnp.bfloat16, sharding=sh),
          jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=sh))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    jax.jit(tiny_cost_kernel).lower(*args).compile()
  (path,) = tpu_llo.find_kernel_dumps(dump_dir)
  k = tpu_llo.parse_kernel(path)
  print(json.dumps({"name": k.name, "grid": list(k.grid), "ops": k.ops, "op_names": k.op_names,
                    "dma_bytes_per_step": k.dma_bytes_per_step,
                    "windows": [[w.name, w.block_bytes, w.varies_with_inner] for w in k.windows]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
