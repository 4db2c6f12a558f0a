"""kda_plugin: Kimi Delta Attention for JAX, and its attention backends for the `model` host."""

__version__ = "0.1.0"


def register(overwrite: bool = False) -> list[str]:
  """Registers kda_native, kda_chunked and kda_reference in `model.registry` (also done automatically
  through the `model.attention_backends` entry points). Returns the registered names."""
  # Imported here, not at the top: `import kda_plugin` (e.g. for kda_plugin.ops alone) must not need
  # the host, and kda_plugin.plugin checks first that `model` is this project's (kda_plugin/_install.py).
  from kda_plugin.plugin import BACKENDS
  from model import registry

  for name, factory in BACKENDS.items():
    registry.register_backend(name, factory, overwrite=overwrite)
  return sorted(BACKENDS)
