"""One process of a 2-process (2 simulated hosts x 4 CPU devices) job started through the config
keys `distributed_init`, `coordinator_address`, `num_processes`, `process_id`.

Usage: `python -m tests.sharding.multidevice.md_two_processes PORT PROCESS_ID` with
`XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu` (tests/sharding/
test_multidevice.py starts both). Prints one JSON line: the process's view of the mesh and the
packed-batch loss on the 8-device mesh (data=2 across the processes x tensor=4) next to its own
one-device loss of the same parameters.
"""

from __future__ import annotations

import json
import sys

import jax


def main(port: int, pid: int) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
  import numpy as np
  from flax import nnx

  from model import sharding
  from model.kimi_linear import KimiLinearForCausalLM
  from tests.sharding.multidevice import common as c

  keys = ("distributed_init=true", f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={pid}",
          "ici_data_parallelism=2", "ici_tensor_parallelism=4")
  cfg = c.config(*keys)
  assert sharding.initialize_distributed(cfg) is True  # before anything touches a device
  mesh = sharding.create_mesh(cfg)
  ids, seg = c.packed_batch()
  graphdef, state = nnx.split(KimiLinearForCausalLM(cfg))  # same seed in both processes: same values
  loss = lambda st, i, s: c.loss_fn(graphdef, *st.split(nnx.Param, ...), i, s)
  local = float(jax.jit(loss)(state, ids, seg))  # this process's first device only
  _, abstract = sharding.abstract_state(cfg, mesh)
  batch = sharding.batch_sharding(mesh, ids.shape, rules_or_cfg=cfg)
  with sharding.mesh_context(mesh, cfg):
    glob = float(jax.jit(loss)(jax.device_put(state, sharding.state_shardings(abstract)),
                               jax.device_put(ids, batch), jax.device_put(seg, batch)))
  rows = [sorted({d.process_index for d in np.asarray(mesh.devices)[i].flat}) for i in range(mesh.shape["data"])]
  print(json.dumps(dict(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                        local_devices=jax.local_device_count(), mesh=sharding.describe_mesh(mesh),
                        data_row_processes=rows, local_loss=local, mesh_loss=glob)))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
