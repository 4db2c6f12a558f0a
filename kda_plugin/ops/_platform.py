"""The platform a KDA call is traced for: the abstract device under `jax.sharding.use_abstract_mesh`
(ahead-of-time export for a TPU or GPU from any host), else `jax.default_backend()`."""

from __future__ import annotations

import jax


def abstract_device():
  """The abstract mesh's device when tracing under `jax.sharding.use_abstract_mesh`, else None."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  return getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None


def target_platform() -> str:
  """"tpu", "gpu" (CUDA or ROCm), "cpu", ...: the abstract device's platform, else the default
  backend's."""
  device = abstract_device()
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform
