"""Shared set-up of the training tests: a learnable token-id corpus and one tiny training config.

Every test trains the same shapes (tiny config, T=32, B=4) so that a pytest worker compiles the
train step once (`model.training.steps.train_step_fn` is cached on graphdef and optimizer).
"""

from __future__ import annotations

import numpy as np

from model.config import load_config

VOCAB = 64          # tiny config
FIRST_ID = 4        # ids 0..3: pad, bos(1), eos(2) of the tiny config, and one unused id
SEQ_LEN, BATCH = 32, 4


def counting_documents(num_docs: int, seed: int) -> list[list[int]]:
  """Documents that count upward (wrapping inside [FIRST_ID, VOCAB)) from a random start: every
  token but the first is fixed by its predecessor, so a model can beat the unigram entropy
  (about log(60) nats) by far, while a unigram model cannot."""
  rng = np.random.default_rng(seed)
  span = VOCAB - FIRST_ID
  docs = []
  for _ in range(num_docs):
    start, n = int(rng.integers(span)), int(rng.integers(5, 21))
    docs.append([FIRST_ID + (start + i) % span for i in range(n)])
  return docs


def write_ids_corpus(path, docs) -> None:
  """One document per line, ids separated by spaces (train_data_format=ids)."""
  path.write_text("".join(" ".join(map(str, d)) + "\n" for d in docs))


# Two layers keep every kind of block (a KDA mixer, an MLA mixer, a dense FFN, an MoE FFN) at half
# the tiny model's compile time.
TWO_LAYERS = ("num_hidden_layers=2", "kda_layers=[1]", "full_attn_layers=[2]")


def tiny_config(corpus, output_dir, *extra: str):
  """The tiny model cut to two layers, with the shared training shapes; `extra` are more key=value
  overrides."""
  return load_config(["tiny", *TWO_LAYERS, f"train_data={corpus}", "train_data_format=ids", f"output_dir={output_dir}",
                      f"seq_len={SEQ_LEN}", f"batch_size={BATCH}", "warmup_steps=2", "log_every=1",
                      "eval_every=0", "checkpoint_every=2", "learning_rate=3e-3", *extra])
