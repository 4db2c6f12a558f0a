"""model/checkpoint/format.py: save/load round trip, overrides, atomicity, clear errors."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import loading
from model.checkpoint import format as ck
from model.checkpoint import orbax_logs
from model.config import ConfigError, load_config


@pytest.fixture(scope="module")
def tiny():
  """The tiny model with random values in every variable (the router bias too, so a dropped
  RouterBias would show); filled from NumPy because eager random init is slow on CPU."""
  cfg = load_config(["tiny"])
  graphdef, state = nnx.split(loading.abstract_model(cfg))
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
  assert sorted(os.listdir(saved)) == ["checksums.json", "config.json", "params", "tokenizer.model"]
  stored = json.loads((saved / "config.json").read_text())
  assert stored["tokenizer_path"] == "tokenizer.model" and stored["load_parameters_path"] == ""
  assert stored["hidden_size"] == cfg.hidden_size and stored["kda_layers"] == list(cfg.kda_layers)
  # No temp or partial-save leftovers beside the checkpoint.
  assert os.listdir(saved.parent) == ["tiny"]


def test_round_trip_bit_exact(saved, tiny):
  cfg, model = tiny
  loaded, lcfg = loading.load_model(saved)
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
  model, cfg = loading.load_model(saved, ["attention=kda_reference", "weight_dtype=bfloat16"])
  assert cfg.attention == "kda_reference" and cfg.hidden_size == 32
  kernel = model.lm_head.kernel.get_value()
  assert kernel.dtype == jnp.bfloat16
  ref, _ = loading.load_model(saved)
  np.testing.assert_array_equal(np.asarray(kernel), np.asarray(ref.lm_head.kernel.get_value().astype(jnp.bfloat16)))
  with pytest.raises(ConfigError, match="hidden_sizee"):
    loading.load_model(saved, ["hidden_sizee=3"])
  with pytest.raises(ck.CheckpointError, match=r"lm_head.kernel is stored with shape \(32, 64\)"):
    loading.load_model(saved, ["hidden_size=16"])


def test_abstract_reads_no_arrays(saved):
  model, cfg = loading.load_model(saved, abstract=True)
  assert cfg.model_name == "tiny"
  graphdef, state = nnx.split(model)
  assert all(hasattr(v, "shape") and not hasattr(v, "block_until_ready") for v in ck.flatten(state).values())
  restored = ck.restore_parameters(saved, state)
  np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, restored).lm_head.kernel.get_value()),
                                np.asarray(loading.load_model(saved)[0].lm_head.kernel.get_value()))


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
    loading.load_model(tmp_path / "nope")
  with pytest.raises(ck.CheckpointError, match="has no config.json"):
    loading.load_model(tmp_path)
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text("{not json")
  (broken / "params").mkdir()
  with pytest.raises(ck.CheckpointError, match="broken/config.json: not a valid model config"):
    loading.load_model(broken)
  (broken / "config.json").write_text((saved / "config.json").read_text())
  with pytest.raises(ck.CheckpointError, match="broken/params: cannot read"):
    loading.load_model(broken)


def test_load_model_from_relative_path(saved, tiny, monkeypatch):
  """A relative load_parameters_path works (Orbax itself needs absolute paths)."""
  _, model = tiny
  monkeypatch.chdir(saved.parent)
  loaded, _ = loading.load_model(saved.name)
  want = nnx.to_pure_dict(nnx.state(model))
  got = nnx.to_pure_dict(nnx.state(loaded))
  jax.tree.map(np.testing.assert_array_equal, want, got)


def _corrupt_copy(src, dst, min_size=1000):
  """`dst`: a copy of checkpoint `src` whose files under params/state/**/d/ (OCDBT data files) larger
  than `min_size` bytes are truncated to 1000 bytes (the QA reproduction: `truncate -s 1000` on the
  large files under params/)."""
  shutil.copytree(src, dst)
  data = [f for f in (dst / "params").rglob("*") if f.is_file() and f.parent.name == "d" and f.stat().st_size > min_size]
  assert data, "no array data files found to truncate"
  for f in data:
    os.truncate(f, 1000)
  return dst


def test_truncated_params_one_line_error(saved, tmp_path):
  """A truncated params/ is one CheckpointError line naming load_parameters_path and TensorStore's
  first line (not Orbax's multi-line TensorStore spec), whether the array data (a restore error) or
  the file holding the arrays' zarr metadata (Orbax returns no metadata) was cut."""
  cases = {"data": _corrupt_copy(saved, tmp_path / "data", min_size=100_000),  # only the 170 kB data file
           "all": _corrupt_copy(saved, tmp_path / "all")}
  for name, bad in cases.items():
    loads = (lambda: loading.load_model(bad), lambda: ck.read_parameters(bad, ["lm_head.kernel", "model.norm.scale"]),
             lambda: ck.stored_parameters(bad))
    for i, load in enumerate(loads):
      if name == "data" and i == 2:
        assert "lm_head.kernel" in load()  # the metadata is intact: only reading the arrays fails
        continue
      with pytest.raises(ck.CheckpointError) as info:
        load()
      msg = str(info.value)
      assert "\n" not in msg, msg
      assert msg.startswith(f"load_parameters_path={bad}: params/ is corrupt or truncated (OUT_OF_RANGE: ") or \
          msg.startswith(f"load_parameters_path={bad}: params/ is corrupt or truncated (ValueError: OUT_OF_RANGE: "), msg
      assert "is not valid for value of size 1000" in msg and "TensorStore(" not in msg, msg


def test_truncated_params_cli_prints_one_line(tmp_path):
  """`python -m tools.generate` on a truncated copy of the demo checkpoint: exactly one stderr line,
  exit 2. Orbax leaves TensorStore reads running after the first failure, whose "Event loop is
  closed" tracebacks and asyncio "exception was never retrieved" records used to surround the error
  line (itself a multi-line TensorStore spec): about 90 lines."""
  import sys
  from tools.demo import ASSETS
  bad = _corrupt_copy(ASSETS, tmp_path / "bad", min_size=100_000)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, "-m", "tools.generate", f"load_parameters_path={bad}", "prompt=hi",
                      "max_new_tokens=4"], cwd=repo, capture_output=True, text=True, timeout=300)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
  assert lines[0].startswith(f"error: load_parameters_path={bad}: params/ is corrupt or truncated ("), lines[0]
  assert not r.stdout


def test_orphaned_read_noise_filter(tmp_path):
  """`orbax_logs.quiet_orphaned_reads` drops only the leftovers of a failed Orbax load ("Event loop is closed"
  from an event loop's _check_closed, exceptions naming the params/ being read) and passes everything
  else on; after a successful load it hands what it held back to the previous hook."""
  seen = []
  previous = lambda u: seen.append(str(u.exc_value))  # the hook installed before the load

  def _check_closed():
    raise RuntimeError("Event loop is closed")

  def unraisable(exc_fn):
    try:
      exc_fn()
    except Exception as e:
      return types.SimpleNamespace(exc_value=e, exc_type=type(e), exc_traceback=e.__traceback__, object=None,
                                   err_msg=None)

  def other():
    raise RuntimeError("Event loop is closed")  # same text, but not raised by a loop's _check_closed

  def tensorstore():
    raise ValueError(f'OUT_OF_RANGE: in OCDBT database at local file "{tmp_path / "params"}/state/"')

  old = sys.unraisablehook
  sys.unraisablehook = previous
  state = dict(orbax_logs._filter_state)
  orbax_logs._filter_state.update(previous=None, held=None, failed=False, paths=set())
  try:
    with orbax_logs.quiet_orphaned_reads(tmp_path / "params"):  # succeeds: held items are passed on afterwards
      sys.unraisablehook(unraisable(_check_closed))
      sys.unraisablehook(unraisable(other))
      assert seen == ["Event loop is closed"]  # only `other` went through at once
    assert seen == ["Event loop is closed"] * 2 and sys.unraisablehook is previous
    seen.clear()
    with pytest.raises(ck.CheckpointError):
      with orbax_logs.quiet_orphaned_reads(tmp_path / "params"):
        raise ck.CheckpointError("load failed")
    for fn in (_check_closed, tensorstore, _check_closed):  # stragglers after the failure: dropped
      sys.unraisablehook(unraisable(fn))
    sys.unraisablehook(unraisable(other))
    sys.unraisablehook(unraisable(lambda: 1 / 0))
    assert seen == ["Event loop is closed", "division by zero"]
  finally:
    sys.unraisablehook = old
    orbax_logs._filter_state.clear()
    orbax_logs._filter_state.update(state)
    logging.getLogger("asyncio").removeFilter(orbax_logs._asyncio_filter)


def test_a_hugging_face_directory_is_named_as_one():
  """Passing the HF folder itself as load_parameters_path points to the converter, not to a missing params/."""
  import pathlib
  hf = pathlib.Path(__file__).parents[1] / "fixtures" / "hf_tiny_dense_moe"
  with pytest.raises(ck.CheckpointError, match=r"is a Hugging Face directory .* convert it first with `kda-convert "
                                               r"hf_model_path=.*hf_tiny_dense_moe output_path=DIR`"):
    loading.read_config(hf)
