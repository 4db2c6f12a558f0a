"""Fixtures of the serving tests: the transformers fixtures converted with tools.convert_checkpoint,
their models loaded once per backend, and a small sentencepiece tokenizer."""

from __future__ import annotations

import functools
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
HF = {"dense": FIXTURES / "hf_tiny_dense_moe", "sharded": FIXTURES / "hf_tiny_sharded"}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
  """{"dense": DIR, "sharded": DIR}: both HF fixtures converted to project checkpoints."""
  from tools import convert_checkpoint as cc
  root = tmp_path_factory.mktemp("serving_ckpt")
  for name, src in HF.items():
    cc.convert([f"hf_model_path={src}", f"output_path={root / name}"])
  return {name: root / name for name in HF}


@pytest.fixture(scope="session")
def load(checkpoints):
  """`load(name, attention)` -> (model, config), cached."""
  from model.loading import load_model

  @functools.lru_cache(maxsize=None)
  def get(name, attention):
    return load_model(checkpoints[name], [f"attention={attention}"])
  return get


@pytest.fixture(scope="session")
def reference():
  """`reference(name)` -> the fixture's reference.npz (transformers' outputs)."""
  return lambda name: np.load(HF[name] / "reference.npz")


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory):
  """A 320-piece BPE sentencepiece model (ids < 320 fit the dense fixture's vocabulary of 512)."""
  from tools.train_tokenizer import train_tokenizer
  root = tmp_path_factory.mktemp("serving_tok")
  rng = np.random.default_rng(0)
  words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "house", "garden", "tree", "bird"]
  lines = [" ".join(rng.choice(words, 8)) for _ in range(400)]
  (root / "corpus.txt").write_text("\n".join(lines) + "\n")
  train_tokenizer(str(root / "corpus.txt"), str(root / "tok"), 320, model_type="bpe", num_threads=1)
  return root / "tok.model"
