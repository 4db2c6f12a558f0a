"""The `matmul_precision` job key: validated like every key, traced into the programs of each job
(jax's `jax_default_matmul_precision` is read when jit traces), "default" changes nothing."""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import pytest

from model import aot, partitioning
from model.config import ConfigError, MATMUL_PRECISIONS, load_config, matmul_precision
from model.training import trainer
from tools import forward_check, generate, perplexity, serve

X = jnp.ones((4, 4), jnp.float32)


def _dot_precisions(text: str) -> set[str]:
  """The `precision = [...]` of every dot_general of a StableHLO text."""
  return set(re.findall(r"stablehlo\.dot_general .*?precision = \[(\w+), \w+\]", text))


def _lowered(fn=lambda a: a @ a) -> str:
  return jax.jit(fn).lower(X).as_text()


@pytest.mark.parametrize("value, hlo", [("high", "HIGH"), ("highest", "HIGHEST")])
def test_the_precision_is_traced_into_every_dot_and_restored_after(value, hlo):
  assert _dot_precisions(_lowered()) == {"DEFAULT"}
  with matmul_precision(value):
    assert _dot_precisions(_lowered()) == {hlo}
    assert f"precision = [{hlo}, {hlo}]" in _lowered(lambda a: jnp.einsum("ij,jk->ik", a, a))
  assert _dot_precisions(_lowered()) == {"DEFAULT"}
  assert jax.config.jax_default_matmul_precision is None


def test_default_sets_nothing():
  """No jax setting at all: the program is the one traced without the key, text for text."""
  before = _lowered(lambda a: jnp.tanh(a @ a.T) @ a)
  with matmul_precision("default"):
    assert jax.config.jax_default_matmul_precision is None
    inside = _lowered(lambda a: jnp.tanh(a @ a.T) @ a)
  assert inside == before and _dot_precisions(inside) == {"DEFAULT"}


def test_threads_of_the_job_trace_with_it_too():
  """The server traces its steps on its engine-loop thread: the setting is the process's, not only
  the calling thread's (jax.default_matmul_precision alone is per thread)."""
  seen = []
  with matmul_precision("highest"):
    worker = threading.Thread(target=lambda: seen.append(_lowered()))
    worker.start()
    worker.join()
  assert _dot_precisions(seen[0]) == {"HIGHEST"}


def test_an_enclosing_per_thread_setting_is_kept_and_the_global_one_restored():
  with jax.default_matmul_precision("high"):
    with matmul_precision("highest"):
      assert _dot_precisions(_lowered()) == {"HIGHEST"}
    assert _dot_precisions(_lowered()) == {"HIGH"}
  assert _dot_precisions(_lowered()) == {"DEFAULT"}
  seen = []
  worker = threading.Thread(target=lambda: seen.append(_lowered()))
  worker.start()
  worker.join()
  assert _dot_precisions(seen[0]) == {"DEFAULT"}


def test_a_bad_value_is_a_config_error_naming_the_key():
  assert MATMUL_PRECISIONS == ("default", "high", "highest")
  for value in MATMUL_PRECISIONS:
    assert load_config(["tiny", f"matmul_precision={value}"]).matmul_precision == value
  for bad in ("fastest", "HIGHEST", "float32", ""):
    with pytest.raises(ConfigError, match=r"^matmul_precision must be one of default, high, highest .*got"):
      load_config(["tiny", f"matmul_precision={bad}"])
  with pytest.raises(ConfigError, match="matmul_precision must be one of"), matmul_precision("fastest"):
    pass


def test_a_bfloat16_model_is_refused_anything_but_default():
  # jax's megablox and splash kernels name no dot precision: HIGHEST reaches their bfloat16 operands
  # and Mosaic refuses it (seen compiling megablox for v5e ahead of time)
  assert load_config(["tiny", "dtype=bfloat16"]).matmul_precision == "default"
  for value in ("high", "highest"):
    with pytest.raises(ConfigError, match=rf"^matmul_precision={value} with dtype=bfloat16: .*use matmul_precision=default, "
                                          "or dtype=float32"):
      load_config(["tiny", "dtype=bfloat16", f"matmul_precision={value}"])


def test_the_key_stays_out_of_checkpoints():
  import json

  from model.config import checkpoint_json, section_of
  assert section_of("matmul_precision") == "mesh"   # a job key, as scan_layers and remat_policy
  assert "matmul_precision" not in json.loads(checkpoint_json(load_config(["tiny", "matmul_precision=high"])))


@pytest.mark.parametrize("mode", ["decode", "train"])
def test_the_ahead_of_time_programs_carry_it(mode):
  """model/aot.py lowers the tiny model's programs (on this CPU) under the key: every dot is HIGHEST
  with `highest`; the default leaves the dots that name no precision of their own at DEFAULT."""
  keys = ["tiny", "batch_size=2", "seq_len=8", "max_cache_length=8"]
  mesh = partitioning.create_mesh(load_config(keys), jax.devices()[:1])
  default = aot.lower(load_config(keys), mode, mesh)[0].as_text()
  highest = aot.lower(load_config([*keys, "matmul_precision=highest"]), mode, mesh)[0].as_text()
  assert "DEFAULT" in _dot_precisions(default)
  assert _dot_precisions(highest) == {"HIGHEST"}
  assert jax.config.jax_default_matmul_precision is None


def _seen_by(monkeypatch, module, name):
  """Replaces `module.name` (a job's body) by a recorder of the precision jax would trace with."""
  seen = []

  def record(*args, **kwargs):
    seen.append(jax.config.jax_default_matmul_precision)
    return 0 if module is not trainer else {}
  monkeypatch.setattr(module, name, record)
  return seen


@pytest.mark.parametrize("module, body, argv", [
    (generate, "_generate", ["load_parameters_path=/nonexistent", "prompt_ids=1"]),
    (serve, "_serve", ["load_parameters_path=/nonexistent"]),
    (perplexity, "_score", ["load_parameters_path=/nonexistent", "eval_data=/nonexistent"]),
    (forward_check, "_check", ["tiny"]),
], ids=["generate", "serve", "perplexity", "forward_check"])
def test_each_tool_runs_its_job_under_the_key(monkeypatch, module, body, argv):
  seen = _seen_by(monkeypatch, module, body)
  assert module.main([*argv, "matmul_precision=highest"]) == 0
  assert module.main(argv) == 0
  assert seen == ["highest", None]
  assert jax.config.jax_default_matmul_precision is None


@pytest.mark.parametrize("module, argv", [
    (generate, ["load_parameters_path=/nonexistent", "prompt_ids=1"]),
    (serve, ["load_parameters_path=/nonexistent"]),
    (perplexity, ["load_parameters_path=/nonexistent", "eval_data=/nonexistent"]),
    (forward_check, ["tiny"]),
], ids=["generate", "serve", "perplexity", "forward_check"])
def test_each_tool_refuses_a_bad_value_in_one_line(capsys, module, argv):
  assert module.main([*argv, "matmul_precision=fast"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: matmul_precision must be one of default, high, highest"), err
  assert [line for line in err if line.startswith("error:")] == [err[-1]]


def test_training_runs_under_the_key(monkeypatch):
  seen = _seen_by(monkeypatch, trainer, "_train")
  trainer.train(load_config(["tiny", "matmul_precision=high"]))
  trainer.train(load_config(["tiny"]))
  assert seen == ["high", None]
