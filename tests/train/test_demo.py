"""The embedded demo checkpoint (kda_plugin/assets/demo) and `make demo` (tools.demo)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from model import loading
from model.checkpoint import format as checkpointing
from model.config import load_config
from model.data.tokenizer import SentencePieceTokenizer
from tools import demo


def test_demo_assets_fit_the_demo_config():
  # Reads metadata only: the shipped checkpoint is complete, is the configs/demo.py model, and its
  # tokenizer agrees with the config's vocabulary and special ids.
  assert checkpointing.is_checkpoint(demo.ASSETS)
  assert (demo.ASSETS / "TRAINING.md").is_file()
  cfg = checkpointing.read_config(demo.ASSETS)
  want = load_config(["demo"])
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_layers", "full_attn_layers", "num_experts",
              "moe_intermediate_size", "bos_token_id", "eos_token_id", "pad_token_id"):
    assert list(np.atleast_1d(cfg[key])) == list(np.atleast_1d(want[key])), key
  assert set(cfg.kda_layers) and set(cfg.full_attn_layers)  # a hybrid: KDA and MLA layers
  tok = SentencePieceTokenizer(cfg.tokenizer_path)
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (cfg.vocab_size, cfg.bos_token_id,
                                                                   cfg.eos_token_id, cfg.pad_token_id)
  stored = checkpointing.stored_parameters(demo.ASSETS)
  abstract = checkpointing.flatten(nnx.state(loading.abstract_model(cfg)))
  assert sorted(stored) == sorted(abstract)
  for name, (shape, dtype) in stored.items():
    assert shape == tuple(abstract[name].shape), name
    # bfloat16 matrices/embeddings, float32 vectors (export_dtype=bfloat16)
    assert dtype == (np.dtype("bfloat16") if len(shape) >= 2 else np.dtype("float32")), name
  size = sum(p.stat().st_size for p in demo.ASSETS.rglob("*") if p.is_file())
  assert size < 10 * 2**20


@pytest.mark.slow
def test_make_demo_prints_a_continuation(tmp_path):
  out = tmp_path / "gen.json"
  proc = subprocess.run([sys.executable, "-m", "tools.demo", "max_new_tokens=12", "decode_sampling_strategy=greedy",
                         "decode_stop_at_eos=false", f"output_json={out}"], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr
  assert "RANDOMLY INITIALISED" not in proc.stderr
  assert proc.stdout.startswith(demo.DEFAULTS["prompt"])
  result = json.loads(out.read_text())["results"][0]
  assert len(result["generated_ids"]) == 12 and result["text"].strip()


@pytest.mark.slow
def test_demo_without_checkpoint_says_so_and_runs_a_random_model(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(demo, "ASSETS", tmp_path / "absent")
  assert demo.main(["max_new_tokens=4", "decode_sampling_strategy=greedy"]) == 0
  captured = capsys.readouterr()
  assert "NO DEMO CHECKPOINT" in captured.err and "RANDOMLY INITIALISED" in captured.err
  assert captured.out.strip()
