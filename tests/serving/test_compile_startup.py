"""Start-up compilation of the continuous engine: every executable reported (name, seconds, how), compiled
on threads, the persistent compilation cache written and read back, and the shape buckets derived from
the engine's sizes (model/engine/warmup.py, compilation_cache.py, runner.py, scheduler.row_limit)."""

from __future__ import annotations

import io

import jax
import pytest
from flax import nnx

from model.config import load_config
from model.engine import compilation_cache, executables, scheduler
from model.engine.api import Request
from model.engine.config import EngineConfig
from model.engine.continuous import ContinuousEngine
from model.engine.warmup import compile_engine
from model.errors import UsageError
from model.nn.kimi_linear import KimiLinearForCausalLM


@pytest.fixture(scope="module")
def model():
  return KimiLinearForCausalLM(load_config(["tiny"]), rngs=nnx.Rngs(0))


def _greedy(engine, prompt, n=3):
  events = []
  engine.add_request(Request("r", tuple(prompt), n))
  while engine.has_unfinished():
    engine.step(events.append)
  return [e.token_id for e in events]


@pytest.mark.parametrize("budget, max_len, path, expected", [
    (2048, 2048, "decode", (16, 32, 64, 128, 256, 512, 1024, 2048)),
    (2048, 300, "decode", (16, 32, 64, 128, 256, 512, 1024, 1196)),   # P=4 prompts of <= 299 tokens
    (2048, 20, "decode", (16, 32, 64, 76)),                            # 4 x 19
    (2048, 20, "mixed", (16, 32, 64, 128, 152)),                       # 8 slots x 19
    (100, 2048, "decode", (16, 32, 64, 100)),
])
def test_buckets_stop_at_the_largest_row_the_sizes_allow(budget, max_len, path, expected):
  config = EngineConfig(max_num_seqs=8, max_model_len=max_len, max_num_batched_tokens=budget, decode_path=path)
  assert scheduler.buckets(scheduler.row_limit(config)) == expected


def test_cold_then_warm_start_through_the_persistent_cache(model, tmp_path, monkeypatch):
  """A first engine compiles every executable (on two threads) and jax writes each to the cache; with
  the process's executables forgotten (as in a new process), a second engine loads every one from the
  cache, and both generate the same greedy tokens."""
  monkeypatch.setattr(executables, "_CACHE", {})
  line = compilation_cache.enable(str(tmp_path / "jax"))
  try:
    assert line == f"compilation cache: {tmp_path / 'jax'}"
    # the mixed route: two executables (buckets 16 and 32), each compiled on its own thread
    config = EngineConfig(max_num_seqs=2, max_model_len=24, max_num_batched_tokens=32, decode_path="mixed")
    cold = ContinuousEngine(model, config)
    out = io.StringIO()
    report = compile_engine(cold, threads=2, file=out)
    names = [r["name"] for r in report.records]
    assert sorted(names) == ["mixed T=16", "mixed T=32"]
    assert report.executables == len(cold.runner.step_shapes()) == 2
    assert report.compiled == 2 and report.from_cache == 0
    assert all(r["how"] == "compiled" and r["seconds"] > 0 for r in report.records)
    assert "compiled 2 step executables in" in out.getvalue() and "mixed T=32" in out.getvalue()
    # the bar names each program while it is traced (seconds each for a large unrolled model)
    assert "tracing mixed T=16 (1/2)" in out.getvalue() and "tracing mixed T=32 (2/2)" in out.getvalue()
    assert len(list((tmp_path / "jax").iterdir())) >= 2
    cold_tokens = _greedy(cold, [5, 6, 7, 8])

    monkeypatch.setattr(executables, "_CACHE", {})   # a new process: nothing compiled in memory
    warm = ContinuousEngine(model, config)
    report = compile_engine(warm, threads=1, progress=False, file=io.StringIO())
    assert report.from_cache == 2 and report.compiled == 0, report.records
    assert all(r["how"] == "loaded from the persistent cache" for r in report.records)
    assert _greedy(warm, [5, 6, 7, 8]) == cold_tokens

    # a third engine over the same model in the same process shares the executables
    report = compile_engine(ContinuousEngine(model, config), progress=False, file=io.StringIO())
    assert report.shared == 2 and report.compiled == report.from_cache == 0
  finally:
    compilation_cache.enable("none")


def test_cache_directory_rules(tmp_path, monkeypatch):
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compilation_cache.resolve_dir("") == tmp_path / "xdg" / "kda_plugin" / "jax"
  monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "env"))
  assert compilation_cache.resolve_dir("") == tmp_path / "env"
  assert compilation_cache.resolve_dir(str(tmp_path / "given")) == tmp_path / "given"
  assert compilation_cache.resolve_dir("none") is None and compilation_cache.resolve_dir("off") is None
  # As a key=value override: "none" must stay the word (the override rule makes other ""-default keys "")
  from model.config import load_config   # noqa: PLC0415
  for word in ("none", "off"):
    cfg = load_config(["demo", f"compilation_cache_dir={word}"])
    assert compilation_cache.resolve_dir(cfg.compilation_cache_dir) is None
  assert load_config(["demo", "tokenizer_path=none"]).tokenizer_path == ""
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(UsageError, match="compilation_cache_dir=.*cannot write there"):
    compilation_cache.enable(str(blocker / "sub"))
  assert compilation_cache.enable("none") == "compilation cache: off (every start compiles)"
  assert compilation_cache.directory() is None
  assert jax.config.jax_enable_compilation_cache is False
