"""kda_plugin: Kimi Delta Attention for JAX, and its attention backends for the `model` host."""

__version__ = "0.1.0"


def register(overwrite: bool = False) -> list[str]:
  """Registers kda_native, kda_chunked and kda_reference in `model.registry` (also done automatically
  through the `model.attention_backends` entry points). Returns the registered names."""
  from model import registry  # the host; imported here only, so kda_plugin.ops stays host-free
  from kda_plugin.plugin import BACKENDS

  for name, factory in BACKENDS.items():
    registry.register_backend(name, factory, overwrite=overwrite)
  return sorted(BACKENDS)
