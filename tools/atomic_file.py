"""Kept for the kernel issue's tools (tools/tpu_cost.py, tools/gpu_cost.py), which import it from
here: the one atomic-write helper is `model.atomic`. Delete this module once they import that."""

from model.atomic import atomic_writer, default_mode

__all__ = ["atomic_writer", "default_mode"]
