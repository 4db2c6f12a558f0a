"""Hugging Face interchange: the Kimi-Linear name table (`names`) and conversion (`convert`) between
transformers' safetensors checkpoints and the project's checkpoint. Above `model.loading`, which it
uses to build the model whose names it maps; nothing below imports it."""
