"""One load path: each tool loads a checkpoint through `model.loading.load`, reading config.json once
and validating the config once per load (counted by wrapping the two functions that do it)."""

from __future__ import annotations

import pytest

import model.checkpoint.format as ckpt_format
import model.config as config_module
from model import loading
from tools import demo, generate, perplexity
from tools.cli import run_tool


@pytest.fixture
def counts(monkeypatch):
  seen = {"config.json reads": 0, "validations": 0, "loads": 0}
  read, validate, load = ckpt_format.read_config_text, config_module.validate_config, loading.load

  def counted_read(path):
    seen["config.json reads"] += 1
    return read(path)

  def counted_validate(cfg):
    seen["validations"] += 1
    return validate(cfg)

  def counted_load(*a, **k):
    seen["loads"] += 1
    return load(*a, **k)

  monkeypatch.setattr(ckpt_format, "read_config_text", counted_read)
  # Every module that validates holds the function by name (`from model.config import ...`).
  for module in (config_module, ckpt_format):
    monkeypatch.setattr(module, "validate_config", counted_validate)
  monkeypatch.setattr(loading, "load", counted_load)
  return seen


def test_generate_reads_and_validates_once(checkpoints, counts, capsys):
  status = run_tool(generate.main, generate.__doc__, [f"load_parameters_path={checkpoints['dense']}",
                                                       "attention=kda_reference", "prompt_ids=5,6,7",
                                                       "max_new_tokens=2"])
  assert status == 0, capsys.readouterr().err
  assert counts == {"config.json reads": 1, "validations": 1, "loads": 1}


def test_perplexity_reads_and_validates_once(checkpoints, counts, tmp_path, capsys):
  data = tmp_path / "ids.txt"
  data.write_text("3 4 5 6 7\n8 9 10\n")
  status = run_tool(perplexity.main, perplexity.__doc__, [f"load_parameters_path={checkpoints['dense']}",
                                                           "attention=kda_reference", f"eval_data={data}",
                                                           "eval_format=ids", "max_target_length=8"])
  assert status == 0, capsys.readouterr().err
  assert counts == {"config.json reads": 1, "validations": 1, "loads": 1}


def test_demo_goes_through_the_same_load(counts, capsys):
  assert demo.main(["max_new_tokens=2", "decode_sampling_strategy=greedy"]) == 0, capsys.readouterr().err
  assert counts == {"config.json reads": 1, "validations": 1, "loads": 1}


def test_load_model_is_the_same_path(checkpoints, counts):
  model, cfg = loading.load_model(checkpoints["dense"], ["attention=kda_reference"])
  assert cfg.attention == "kda_reference" and model.backend.name == "kda_reference"
  assert counts == {"config.json reads": 1, "validations": 1, "loads": 1}
