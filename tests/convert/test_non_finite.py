"""Non-finite weights are refused: by the converter (one line naming the first such tensor, in both
directions) and by the one load path (`model.loading`, used by generate / perplexity / serve), each
unless `allow_non_finite=true`."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model import loading
from model.checkpoint import format as ck
from tools import convert_checkpoint as cc
from tools import generate
from tools.cli import run_tool

REPO = pathlib.Path(__file__).resolve().parents[2]
DENSE = REPO / "tests" / "fixtures" / "hf_tiny_dense_moe"
BAD = "model.layers.2.self_attn.kv_b_proj.weight"  # the tensor that gets a NaN


def _source_with_nan(dst: pathlib.Path, value=np.nan) -> pathlib.Path:
  dst.mkdir()
  tensors = load_file(DENSE / "model.safetensors")
  t = tensors[BAD].copy()
  t[1, 3] = value
  t[2, 0] = value
  tensors[BAD] = t
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  (dst / "config.json").write_text((DENSE / "config.json").read_text())
  return dst


def _one_error(capsys) -> str:
  """The one `error:` line on stderr, which must be its last line (a conversion's progress bar may
  precede it)."""
  err = capsys.readouterr().err.strip().splitlines()
  errors = [line for line in err if line.startswith("error: ")]
  assert len(errors) == 1 and err[-1] == errors[0], err
  assert not any("Traceback" in line for line in err), err
  return errors[0]


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_conversion_refuses_a_non_finite_tensor(tmp_path, capsys, value):
  src = _source_with_nan(tmp_path / "src", value)
  assert cc.main([f"hf_model_path={src}", f"output_path={tmp_path / 'ck'}"]) == 2
  err = _one_error(capsys)
  assert BAD in err and "2 non-finite value(s)" in err and "(1, 3)" in err and "allow_non_finite=true" in err, err
  assert not (tmp_path / "ck").exists() and not list(tmp_path.glob(".ck*"))


@pytest.fixture
def nan_checkpoint(tmp_path, capsys):
  """A project checkpoint holding a NaN, written with the debugging key."""
  src = _source_with_nan(tmp_path / "src")
  assert cc.main([f"hf_model_path={src}", f"output_path={tmp_path / 'ck'}", "allow_non_finite=true"]) == 0
  capsys.readouterr()
  got = ck.read_parameters(tmp_path / "ck", ["model.layers.2.self_attn.kv_b_proj.kernel"])
  assert np.isnan(next(iter(got.values()))).sum() == 2  # the NaNs really are stored
  return tmp_path / "ck"


def test_to_hf_refuses_a_non_finite_parameter(nan_checkpoint, tmp_path, capsys):
  out = tmp_path / "hf"
  assert cc.main(["direction=to_hf", f"load_parameters_path={nan_checkpoint}", f"output_path={out}"]) == 2
  err = _one_error(capsys)
  assert "model.layers.2.self_attn.kv_b_proj.kernel" in err and "allow_non_finite=true" in err, err
  assert not out.exists()
  assert cc.main(["direction=to_hf", f"load_parameters_path={nan_checkpoint}", f"output_path={out}",
                  "allow_non_finite=true"]) == 0


def test_loading_refuses_a_non_finite_parameter(nan_checkpoint):
  with pytest.raises(ck.CheckpointError, match=r"parameter model\.layers\.2\.self_attn\.kv_b_proj\.kernel holds 2 "
                     r"non-finite value\(s\) \(the first, nan, at index \(0, 2\)\).*allow_non_finite=true"):
    loading.load_model(nan_checkpoint)
  model, _ = loading.load_model(nan_checkpoint, ["allow_non_finite=true"])  # for debugging
  assert np.isnan(np.asarray(model.model.layers[2].self_attn.kv_b_proj.kernel.get_value())).sum() == 2


def test_generate_refuses_a_non_finite_checkpoint(nan_checkpoint, capsys):
  rc = run_tool(generate.main, generate.__doc__, [f"load_parameters_path={nan_checkpoint}", "prompt_ids=1,5,7",
                                                  "max_new_tokens=2"])
  assert rc == 2
  err = _one_error(capsys)
  assert "kv_b_proj.kernel" in err and "non-finite" in err, err


def test_bad_allow_non_finite_value(tmp_path, capsys):
  assert cc.main([f"hf_model_path={DENSE}", f"output_path={tmp_path / 'ck'}", "allow_non_finite=maybe"]) == 2
  assert "allow_non_finite must be true or false" in _one_error(capsys)


def test_perplexity_that_is_not_finite_is_an_error(nan_checkpoint, tmp_path, capsys):
  """A NaN weight let through for debugging: perplexity is an error naming the document and token,
  never `perplexity nan` with exit status 0."""
  from tools import perplexity
  data = tmp_path / "ids.txt"
  data.write_text("1 5 7 9 11 13\n4 6 8\n")
  rc = run_tool(perplexity.main, perplexity.__doc__, [f"load_parameters_path={nan_checkpoint}", f"eval_data={data}",
                                                      "eval_format=ids", "max_target_length=8", "eval_batch_size=1",
                                                      "allow_non_finite=true"])
  assert rc == 2
  err = _one_error(capsys)
  assert "perplexity is not finite" in err and "token 1 of document 0" in err, err
