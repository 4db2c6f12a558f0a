"""tools.train's compile: announced, timed, loaded from jax's persistent cache on a restart, and a step
that libtpu refuses to compile for memory is one `error:` line naming the keys and the figure."""

from __future__ import annotations

import json

import jax
import pytest

from model.config import load_config
from model.engine import compilation_cache
from model.training import steps as train_lib
from model.training import trainer
from tests.train.helpers import counting_documents, write_ids_corpus
from tests.train.test_train import _argv


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "count.ids"
  write_ids_corpus(path, counting_documents(300, seed=0))
  return path


def _lines(err: str, prefix: str) -> list[str]:
  return [ln for ln in err.splitlines() if ln.startswith(prefix)]


def test_compile_is_announced_and_a_restart_loads_it_from_the_persistent_cache(corpus, tmp_path, capsys):
  """Runs of the same command in one process, jax's in-memory caches cleared between them (a restart): the
  first compiles cold and says how long; the second is announced with the first's seconds and loads the
  step from the cache directory; so does the first run's resumption (a restored state is committed to the
  device as the fresh one is: the same program)."""
  import tools.train as train_tool

  cache = tmp_path / "jax"
  # as in a new process: a test before this one in the same worker may have compiled this very step,
  # which jax would then take from its in-memory cache without compiling (and so without writing it
  # to the persistent cache that the restart below must load it from)
  jax.clear_caches()
  train_lib.train_step_fn.cache_clear()
  try:
    assert train_tool.main(_argv(corpus, tmp_path / "a", "steps=3", "stop_at_step=1", f"compilation_cache_dir={cache}")) == 0
    err = capsys.readouterr().err
    announce, ready = _lines(err, "compiling the train step"), _lines(err, "train step ready in ")
    assert len(announce) == 1 and len(ready) == 1, err
    assert announce[0].startswith("compiling the train step for tiny (") and "at batch_size=4 x seq_len=32 on 1 x " in announce[0]
    assert f"persistent cache at {cache}" in announce[0] and "a first run compiles for seconds" in announce[0]
    assert "(compiled)" in ready[0] and "MiB by XLA's memory analysis of" in ready[0], ready
    times = json.loads((cache / trainer.COMPILE_TIMES_FILE).read_text())
    (cold,) = times.values()
    assert cold > 0
    assert any(p.name != trainer.COMPILE_TIMES_FILE for p in cache.iterdir())  # jax wrote entries

    # a restart: nothing compiled in this process any more (jax's in-memory caches, the step's lru_cache)
    jax.clear_caches()
    train_lib.train_step_fn.cache_clear()
    assert train_tool.main(_argv(corpus, tmp_path / "b", "steps=3", "stop_at_step=1", f"compilation_cache_dir={cache}")) == 0
    err = capsys.readouterr().err
    announce, ready = _lines(err, "compiling the train step"), _lines(err, "train step ready in ")
    assert f"(this takes ~{cold:.0f} s on a first run, as the last cold compile of this step here did; " \
        f"persistent cache at {cache})" in announce[0], announce
    assert "(loaded from the persistent cache)" in ready[0], ready
    assert json.loads((cache / trainer.COMPILE_TIMES_FILE).read_text()) == times  # a hit is no cold figure
    # a resume after a restart (run "a" stopped at step 1): its restored state traces the same program
    jax.clear_caches()
    train_lib.train_step_fn.cache_clear()
    assert train_tool.main(_argv(corpus, tmp_path / "a", "steps=3", f"compilation_cache_dir={cache}")) == 0
    assert "(loaded from the persistent cache)" in _lines(capsys.readouterr().err, "train step ready in ")[0]
    # the same run again without a restart: the executable of this process, said so
    assert train_tool.main(_argv(corpus, tmp_path / "c", "steps=3", "stop_at_step=1", f"compilation_cache_dir={cache}")) == 0
    assert "(compiled earlier in this process)" in _lines(capsys.readouterr().err, "train step ready in ")[0]
  finally:
    compilation_cache.enable("none")


LIBTPU_OOM = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used "
              "33.05G of 15.75G hbm. Exceeded hbm capacity by 17.30G.\n\nTotal hbm usage >= 33.30G: ... the total "
              "memory required for HLO temporaries (33.05G) exceeds available HBM (15.75G) ...")


def test_a_step_the_compiler_refuses_is_one_line_with_its_figure_and_the_keys(corpus, tmp_path, monkeypatch, capsys):
  """libtpu refuses a step that cannot fit at compile time (what a TPU does before memory_analysis can be
  read): simulated with its message; the run stops before any step, names the figure and the keys."""
  import tools.train as train_tool

  real = train_lib.train_step_fn
  ran = []

  def refusing(*args, **kwargs):
    fn = real(*args, **kwargs)

    def step(state, batch):
      ran.append(1)
      return fn(state, batch)

    def compile_step(state, batch, *, reuse=True):
      raise jax.errors.JaxRuntimeError(LIBTPU_OOM)
    step.compile = compile_step
    return step
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", refusing)
  out = tmp_path / "run"
  argv = _argv(corpus, out, "steps=4", "remat_policy=minimal")
  assert train_tool.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  errors = [ln for ln in err if ln.startswith("error:")]
  assert len(errors) == 1 and errors[0] == err[-1], err
  advice = trainer.memory_advice(load_config(argv))
  assert err[-1] == (f"error: out of memory (a train step needs {33.05 * 1024:,.1f} MiB of {15.75 * 1024:,.1f} MiB "
                     f"usable on {jax.devices()[0].device_kind}: the compiler refused it, "
                     f"{LIBTPU_OOM.splitlines()[0]}): {advice}; checked before the first step, nothing was run"), err[-1]
  for key in ("batch_size", "seq_len", "remat_policy=full (now minimal;", "moe_impl=megablox"):
    assert key in err[-1], key
  assert ran == [] and not out.exists()


def test_memory_advice_names_only_the_keys_left_to_change():
  cfg = load_config(["tiny", "remat_policy=full", "moe_impl=ragged"])
  assert trainer.memory_advice(cfg) == f"lower {trainer.MEMORY_KEYS}"
  cfg = load_config(["tiny", "remat_policy=none", "moe_impl=dense"])
  advice = trainer.memory_advice(cfg)
  assert "remat_policy=full (now none;" in advice and "(now dense, dense here" in advice
