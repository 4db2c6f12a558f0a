"""One process of a 2-process (2 simulated hosts x 4 CPU devices) job started through the config
keys `distributed_init`, `coordinator_address`, `num_processes`, `process_id`.

Usage: `python -m tests.sharding.multidevice.md_two_processes PORT PROCESS_ID` with
`XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu` (tests/sharding/
test_multidevice.py starts both). Prints one JSON line: the process's view of the mesh and the
packed-batch loss on the 8-device mesh (data=2 across the processes x tensor=4) next to its own
one-device loss of the same parameters; then the losses of TRAIN_STEPS training steps
(`model.training.steps`, as tools.train runs them) on that mesh, where this process builds only its half
of each global batch (`train_lib.feed_on_mesh`: rows `process_rows`, assembled by
`jax.make_array_from_process_local_data`), next to the losses of the same steps on one device of
this process from the whole global batch.
"""

from __future__ import annotations

import json
import sys

import jax

TRAIN_STEPS = 3


def main(port: int, pid: int) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
  import numpy as np
  from flax import nnx

  from model import loading, partitioning
  from model.nn.kimi_linear import KimiLinearForCausalLM
  from tests.sharding.multidevice import common as c

  keys = ("distributed_init=true", f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={pid}",
          "ici_data_parallelism=2", "ici_tensor_parallelism=4")
  cfg = c.config(*keys)
  assert partitioning.initialize_distributed(cfg) is True  # before anything touches a device
  mesh = partitioning.create_mesh(cfg)
  ids, seg = c.packed_batch()
  graphdef, state = nnx.split(KimiLinearForCausalLM(cfg))  # same seed in both processes: same values
  loss = lambda st, i, s: c.loss_fn(graphdef, *st.split(nnx.Param, ...), i, s)
  local = float(jax.jit(loss)(state, ids, seg))  # this process's first device only
  _, abstract = loading.abstract_state(cfg, mesh)
  batch = partitioning.batch_sharding(mesh, ids.shape, rules_or_cfg=cfg)
  with partitioning.mesh_context(mesh, cfg):
    glob = float(jax.jit(loss)(jax.device_put(state, partitioning.state_shardings(abstract)),
                               jax.device_put(ids, batch), jax.device_put(seg, batch)))
  train = _train_losses(cfg, mesh)
  # A parameter sharded across both processes (not fully addressable here): its checksum, as a
  # multi-host export records it, is that of the whole array (was: np.asarray refused the array).
  from jax.sharding import NamedSharding, PartitionSpec
  from model.checkpoint import checksums
  whole = np.arange(8 * 32, dtype=np.float32).reshape(8, 32) * 0.5
  spread = jax.make_array_from_callback(whole.shape, NamedSharding(mesh, PartitionSpec("data", "tensor")),
                                        lambda idx: whole[idx])
  sharded_crc = dict(fully_addressable=spread.is_fully_addressable, crc32=checksums.checksum_entry(spread),
                     whole=checksums.checksum_entry(whole))
  rows = [sorted({d.process_index for d in np.asarray(mesh.devices)[i].flat}) for i in range(mesh.shape["data"])]
  print(json.dumps(dict(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                        local_devices=jax.local_device_count(), mesh=partitioning.describe_mesh(mesh),
                        data_row_processes=rows, local_loss=local, mesh_loss=glob, sharded_crc=sharded_crc,
                        **train)))
  jax.distributed.shutdown()


def _train_losses(cfg, mesh) -> dict:
  """Per-step losses of TRAIN_STEPS steps on `mesh` (this process feeding only its rows) and on
  this process's first device alone (the whole batch), from the same initial state and batches."""
  import numpy as np

  from model import partitioning
  from model.training import steps as train_lib
  from model.data.pipeline import BatchIterator, pack_documents
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 64, rng.integers(4, 20)) for _ in range(40)]
  rows = pack_documents(docs, 16, max_segments=cfg.max_num_segments)
  hparams = train_lib.optimizer_hparams(cfg)
  out = {}
  for name, on_mesh in (("one_device", None), ("mesh", mesh)):
    it = BatchIterator(rows, 8, seed=1)
    graphdef, state = train_lib.create_train_state(cfg, hparams, on_mesh)
    step = train_lib.train_step_fn(graphdef, hparams, cfg.max_num_segments)
    losses = []
    if on_mesh is None:
      for _ in range(TRAIN_STEPS):
        state, m = step(state, next(it))
        losses.append(float(m["loss"]))
    else:
      to_global = train_lib.feed_on_mesh(it, on_mesh, cfg)
      out["process_rows"] = [it.process_rows.start, it.process_rows.stop]
      with partitioning.mesh_context(on_mesh, cfg):
        for _ in range(TRAIN_STEPS):
          local = next(it)
          out.setdefault("local_batch_rows", int(local.inputs.shape[0]))
          state, m = step(state, to_global(local))
          losses.append(float(m["loss"]))
    out[f"{name}_train_losses"] = losses
  return out


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
