"""Child script: `model.partitioning.create_mesh` on a real TPU topology's devices for a mesh whose
tensor axis (8) is not a product of whole physical axes of the torus (v6e:4x4, fsdp=2 x tensor=8).

Run in the libtpu compile venv by tests/aot/test_aot_compile.py through `AotRunner`. Prints one JSON
line: the mesh's axis sizes, the warnings create_mesh raised, and whether every device is used once.
"""

from __future__ import annotations

import json
import warnings

from jax.experimental import topologies

from model import partitioning
from model.config import load_config


def main() -> None:
  devices = topologies.get_topology_desc(topology_name="v6e:4x4", platform="tpu").devices
  cfg = load_config(["kimi_linear_48b_a3b", "ici_data_parallelism=1", "ici_fsdp_parallelism=2",
                     "ici_tensor_parallelism=8"])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mesh = partitioning.create_mesh(cfg, devices)
  ids = sorted(d.id for d in mesh.devices.flat)
  print(json.dumps({"shape": dict(mesh.shape), "warnings": [str(w.message) for w in caught],
                    "devices_once": ids == sorted(d.id for d in devices)}))


if __name__ == "__main__":
  main()
