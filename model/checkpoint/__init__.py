"""Checkpoints: the on-disk format (`format`), the Hugging Face name table (`hf_names`), conversion (`convert`)."""
