"""Tests of the checkpoint format (model/checkpointing.py) and tools/convert_checkpoint.py."""
