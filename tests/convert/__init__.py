"""Tests of the checkpoint format (model/checkpoint/format.py) and tools/convert_checkpoint.py."""
