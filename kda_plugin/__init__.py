"""kda_plugin: Kimi Delta Attention for JAX, and its attention backends for the `model` host."""

__version__ = "0.1.0"
