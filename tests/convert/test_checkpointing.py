"""model/checkpointing.py: save/load round trip, overrides, atomicity, clear errors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import checkpointing as ck
from model.config import ConfigError, load_config


@pytest.fixture(scope="module")
def tiny():
  """The tiny model with random values in every variable (the router bias too, so a dropped
  RouterBias would show); filled from NumPy because eager random init is slow on CPU."""
  cfg = load_config(["tiny"])
  graphdef, state = nnx.split(ck.abstract_model(cfg))
  rng = np.random.default_rng(3)
  values = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape).astype(s.dtype)),
                        nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, values)
  return cfg, nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
  cfg, model = tiny
  tok = tmp_path_factory.mktemp("tok") / "sp.model"
  tok.write_bytes(b"not really a sentencepiece model")
  path = tmp_path_factory.mktemp("ckpt") / "tiny"
  ck.save_parameters(path, model, cfg, tokenizer_path=tok)
  return path


def test_layout_and_config(saved, tiny):
  cfg, _ = tiny
  assert sorted(os.listdir(saved)) == ["config.json", "params", "tokenizer.model"]
  stored = json.loads((saved / "config.json").read_text())
  assert stored["tokenizer_path"] == "tokenizer.model" and stored["load_parameters_path"] == ""
  assert stored["hidden_size"] == cfg.hidden_size and stored["kda_layers"] == list(cfg.kda_layers)
  # No temp or partial-save leftovers beside the checkpoint.
  assert os.listdir(saved.parent) == ["tiny"]


def test_round_trip_bit_exact(saved, tiny):
  cfg, model = tiny
  loaded, lcfg = ck.load_model(saved)
  want, got = ck.flatten(nnx.state(model)), ck.flatten(nnx.state(loaded))
  assert sorted(want) == sorted(got)
  assert any(".gate.e_score_correction_bias" in k for k in got)
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
  assert lcfg.load_parameters_path == str(saved)
  assert lcfg.tokenizer_path == str(saved / "tokenizer.model")
  assert os.path.isfile(lcfg.tokenizer_path)


def test_overrides_apply_on_top(saved):
  model, cfg = ck.load_model(saved, ["attention=kda_reference", "weight_dtype=bfloat16"])
  assert cfg.attention == "kda_reference" and cfg.hidden_size == 32
  kernel = model.lm_head.kernel.get_value()
  assert kernel.dtype == jnp.bfloat16
  ref, _ = ck.load_model(saved)
  np.testing.assert_array_equal(np.asarray(kernel), np.asarray(ref.lm_head.kernel.get_value().astype(jnp.bfloat16)))
  with pytest.raises(ConfigError, match="hidden_sizee"):
    ck.load_model(saved, ["hidden_sizee=3"])
  with pytest.raises(ck.CheckpointError, match=r"lm_head.kernel is stored with shape \(32, 64\)"):
    ck.load_model(saved, ["hidden_size=16"])


def test_abstract_reads_no_arrays(saved):
  model, cfg = ck.load_model(saved, abstract=True)
  assert cfg.model_name == "tiny"
  graphdef, state = nnx.split(model)
  assert all(hasattr(v, "shape") and not hasattr(v, "block_until_ready") for v in ck.flatten(state).values())
  restored = ck.restore_parameters(saved, state)
  np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, restored).lm_head.kernel.get_value()),
                                np.asarray(ck.load_model(saved)[0].lm_head.kernel.get_value()))


def test_refuses_overwrite_and_keeps_old(saved, tiny):
  cfg, model = tiny
  before = (saved / "config.json").read_text()
  with pytest.raises(ck.CheckpointError, match="already exists; pass overwrite=true"):
    ck.save_parameters(saved, model, cfg)
  assert (saved / "config.json").read_text() == before


def test_overwrite_replaces(tiny, tmp_path):
  cfg, model = tiny
  path = tmp_path / "c"
  ck.save_parameters(path, model, cfg)
  cfg2 = load_config(["tiny", "model_name=second"])
  ck.save_parameters(path, model, cfg2, overwrite=True)
  assert json.loads((path / "config.json").read_text())["model_name"] == "second"
  assert sorted(os.listdir(tmp_path)) == ["c"]
  other = tmp_path / "notackpt"
  other.mkdir()
  (other / "precious.txt").write_text("x")
  with pytest.raises(ck.CheckpointError, match="not a checkpoint directory"):
    ck.save_parameters(other, model, cfg, overwrite=True)
  assert (other / "precious.txt").exists()


def test_failure_leaves_nothing(tiny, tmp_path):
  cfg, model = tiny
  path = tmp_path / "out"
  with pytest.raises(RuntimeError, match="boom"):
    with ck.ParameterWriter(path, cfg) as w:
      w.write({"lm_head": {"kernel": np.zeros((2, 2), np.float32)}})
      raise RuntimeError("boom")
  assert os.listdir(tmp_path) == []
  with pytest.raises(ck.CheckpointError, match="tokenizer_path"):
    ck.save_parameters(path, model, cfg, tokenizer_path=tmp_path / "missing.model")
  assert os.listdir(tmp_path) == []


def test_clear_errors(saved, tmp_path):
  with pytest.raises(ck.CheckpointError, match="does not exist"):
    ck.load_model(tmp_path / "nope")
  with pytest.raises(ck.CheckpointError, match="has no config.json"):
    ck.load_model(tmp_path)
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text("{not json")
  (broken / "params").mkdir()
  with pytest.raises(ck.CheckpointError, match="broken/config.json: not a valid model config"):
    ck.load_model(broken)
  (broken / "config.json").write_text((saved / "config.json").read_text())
  with pytest.raises(ck.CheckpointError, match="broken/params: cannot read"):
    ck.load_model(broken)


def test_load_model_from_relative_path(saved, tiny, monkeypatch):
  """A relative load_parameters_path works (Orbax itself needs absolute paths)."""
  _, model = tiny
  monkeypatch.chdir(saved.parent)
  loaded, _ = ck.load_model(saved.name)
  want = nnx.to_pure_dict(nnx.state(model))
  got = nnx.to_pure_dict(nnx.state(loaded))
  jax.tree.map(np.testing.assert_array_equal, want, got)
