"""Backend registry, entry-point discovery, kda_plugin.register() and tools.forward_check."""

import os
import subprocess
import sys

import pytest

from model import backend, registry
from model.config import load_config

PLUGIN_BACKENDS = {"kda_native", "kda_chunked", "kda_reference"}


def test_entry_points_declare_the_plugin_backends():
  import importlib.metadata
  eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)}
  assert PLUGIN_BACKENDS <= set(eps)
  assert eps["kda_native"] == "kda_plugin.plugin:kda_native"
  assert PLUGIN_BACKENDS <= set(registry.registered_backends())


def test_explicit_register_is_idempotent_and_routes_modes():
  import kda_plugin
  assert set(kda_plugin.register()) == PLUGIN_BACKENDS
  native = registry.get_backend("kda_native")
  assert native is registry.get_backend("kda_native")
  assert native.routes == {"train": "kda_chunked", "eval": "kda_inference", "prefill": "kda_inference",
                           "decode": "kda_decode_step"}
  assert registry.get_backend("kda_reference").describe("eval") == "kda_reference -> kda_reference"
  assert registry.get_backend("kda_chunked").describe("decode") == "kda_chunked -> kda_decode_step"


def test_custom_backend_registration():
  class Dummy:  # every member of model.backend.AttentionBackend, none of them usable
    name = "dummy_for_test"

    def describe(self, mode, implementation="auto"):
      return f"{self.name} -> nothing"

    def short_conv(self, *a, **k):
      raise NotImplementedError

    short_conv_step = kda = kda_decode = short_conv

  obj = Dummy()
  registry.register_backend("dummy_for_test", obj)
  assert registry.get_backend("dummy_for_test") is obj
  with pytest.raises(ValueError, match="already registered"):
    registry.register_backend("dummy_for_test", Dummy())


def test_registry_checks_the_backend_protocol():
  """An object without the protocol's members, or whose method lacks a protocol parameter, is refused
  at lookup with a TypeError naming what is missing (no duck-typed surprise inside a traced model)."""
  class NoDecode:
    name = "no_decode_for_test"

    def describe(self, mode, implementation="auto"):
      return ""

    def short_conv(self, x, weight, *, segment_ids, cache, max_num_segments):
      raise NotImplementedError

    def short_conv_step(self, x, weight, cache):
      raise NotImplementedError

    def kda(self, q, k, v, g_raw, beta, *, a_log, dt_bias, lower_bound, mode, segment_ids, initial_state,
            output_final_state, max_num_segments):  # no `implementation`
      raise NotImplementedError

  registry.register_backend("no_decode_for_test", NoDecode)  # a class is a factory
  with pytest.raises(TypeError, match=r"'no_decode_for_test'.*lacks kda_decode"):
    registry.get_backend("no_decode_for_test")
  NoDecode.kda_decode = lambda self, *a, **k: None
  registry.register_backend("no_decode_for_test", NoDecode, overwrite=True)
  with pytest.raises(TypeError, match=r"kda\(\) does not take implementation"):
    registry.get_backend("no_decode_for_test")
  assert isinstance(registry.get_backend("kda_native"), backend.AttentionBackend)


def test_unknown_attention_lists_registered_backends():
  from model.nn.kimi_linear import KimiLinearForCausalLM
  with pytest.raises(registry.UnknownBackendError, match=r"unknown attention backend 'kda_nope'.*kda_native"):
    KimiLinearForCausalLM(load_config(["tiny", "attention=kda_nope"]))


def _forward_check(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "tools.forward_check", *args, "--seq", "16", "--batch", "1",
                         "--docs", "2", "--decode-steps", "1", "--repeats", "1"],
                        capture_output=True, text=True, env=env, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_forward_check_is_served_by_the_plugin_through_entry_points():
  # This test process never imports kda_plugin; the subprocess finds it through the entry point.
  # Only eval and prefill/decode run here (the train route compiles kda_chunked, which
  # tests/model/test_model.py already covers); the routes of every mode are asserted in
  # test_explicit_register_is_idempotent_and_routes_modes.
  r = _forward_check("tiny", "attention=kda_native", "--modes", "eval,prefill")
  out = r.stdout + r.stderr
  assert r.returncode == 0, out
  assert "[eval   ] kda_native -> kda_inference[xla]" in out
  assert "[prefill] kda_native -> kda_inference[xla]" in out
  assert "[decode ] kda_native -> kda_decode_step" in out


@pytest.mark.parametrize("config, expect", [
    ([], ["tiny"]),
    (["hidden_size=64"], ["tiny", "hidden_size=64"]),
    (["demo", "hidden_size=64"], ["demo", "hidden_size=64"]),
])
def test_forward_check_without_config_uses_tiny_and_says_so(config, expect, capsys):
  """Was: no config built the 48B base at random and the kernel killed it (exit 137) without a word."""
  from tools import forward_check
  assert forward_check.config_argv(config) == expect
  out = capsys.readouterr().out.strip().splitlines()
  assert out == ([] if config[:1] == ["demo"] else
                 ["no model config given: using 'tiny' (name one first, e.g. demo or kimi-linear-48b-a3b, for another)"])


def test_forward_check_without_config_runs_tiny(capsys, monkeypatch):
  """End to end in process: the model that gets built is tiny (the build is stopped right after the config)."""
  from model import loading
  from tools import forward_check
  built = []

  def create(cfg):
    built.append(cfg.model_name)
    raise forward_check.UsageError("stop after the config")
  monkeypatch.setattr(loading, "create", create)
  assert forward_check.main(["--seq", "8"]) == 2
  assert built == ["tiny"], built
  assert "using 'tiny'" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["tiny", "--batch", "0"], "error: --batch must be >= 1, got 0"),
    (["tiny", "--seq", "-1"], "error: --seq must be >= 1, got -1"),
    (["tiny", "--docs", "99"], "error: --docs=99 exceeds max_num_segments="),
    (["tiny", "--modes", "evil"], "error: --modes: unknown ['evil']"),
    (["tiny", "--repeats", "0"], "error: --repeats must be >= 1, got 0"),  # was "median nan ms"
    (["nosuchconfig"], "error: unknown model config 'nosuchconfig'; available: "),
])
def test_forward_check_bad_arguments_are_one_error_line(argv, message, capsys):
  from tools import forward_check
  assert forward_check.main(argv) == 2  # in process, before any model is built
  out = capsys.readouterr()
  assert out.err.strip().splitlines() == [out.err.strip()] and out.err.startswith(message), out.err
  assert "FAILED" not in out.out


def test_forward_check_out_of_memory_is_one_error_line(capsys, monkeypatch):
  """XLA's RESOURCE_EXHAUSTED (e.g. --seq 100000: 320 GB on CPU) stops the tool with one `error:` line
  naming --seq and --batch and exit status 2, not a FAILED line per mode and status 1. The allocation
  failure is simulated: the first timed call raises the error XLA raises."""
  import jax
  from tools import forward_check
  calls = []

  def oom(fn, *args, repeats):
    calls.append(fn)
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 320134547656 bytes.")
  monkeypatch.setattr(forward_check, "_timed", oom)
  assert forward_check.main(["tiny", "--seq", "32", "--batch", "1", "--docs", "2"]) == 2
  out = capsys.readouterr()
  assert out.err == ("error: out of memory in the train pass (RESOURCE_EXHAUSTED: Out of memory allocating "
                     "320134547656 bytes.): lower --seq (T=32) or --batch (B=1)\n"), out.err
  assert len(calls) == 1 and "FAILED" not in out.out  # stopped at the first mode

  def other(fn, *args, repeats):  # any other failure is still reported per mode, status 1
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")
  monkeypatch.setattr(forward_check, "_timed", other)
  assert forward_check.main(["tiny", "--seq", "32", "--batch", "1", "--docs", "2", "--modes", "eval"]) == 1
  assert "[eval   ] FAILED: JaxRuntimeError: INTERNAL: something else" in capsys.readouterr().out


def test_forward_check_help_and_bad_key():
  r = subprocess.run([sys.executable, "-m", "tools.forward_check", "--help"], capture_output=True, text=True)
  assert r.returncode == 0 and "attention backend" in r.stdout
  r = _forward_check("tiny", "atention=kda_native")
  assert r.returncode == 2 and "did you mean attention" in r.stderr
  r = _forward_check("tiny", "ici_data_parallelism=3", "--modes", "eval")  # one CPU device: an impossible mesh
  assert r.returncode == 2 and "multiply to 3 but there are 1 devices" in r.stderr, r.stderr


def test_describe_is_pure_and_traced_ops_is_the_explicit_hook():
  """Tracing records nothing on a backend; `traced_ops()` is the one, scoped way to see the op a trace used."""
  import jax
  import jax.numpy as jnp

  from model import loading
  native = registry.get_backend("kda_native")
  assert not hasattr(native, "last_calls")
  assert native.describe("eval") == native.describe("eval", "auto") == "kda_native -> kda_inference[xla]"
  with pytest.raises(ValueError, match="mode must be one of"):
    native.describe("serve")
  model = loading.create(load_config(["tiny", "attention=kda_native"]))
  kda_layers = model.args.layer_types.count("kda")
  ids = jnp.ones((1, 16), jnp.int32)
  with native.traced_ops() as seen:
    jax.eval_shape(lambda: model(ids, mode="eval"))
  assert seen == [("eval", "kda_native -> kda_inference[xla]")] * kda_layers
  jax.eval_shape(lambda: model(ids, mode="eval"))  # outside the block: nothing more is recorded
  assert len(seen) == kda_layers and native._observers == []
