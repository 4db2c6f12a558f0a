"""compiled_trainstep_file: a train step compiled ahead of time (model/aot.py's program, as
kda-aot-compile builds it for a TPU topology; here for this CPU) runs in kda-train instead of a compile,
with the losses of the step kda-train compiles itself; a file compiled for another step is refused
before anything is written, naming the differences."""

from __future__ import annotations

import json

import jax
import pytest

from model import aot, partitioning
from model.config import load_config
from model.errors import UsageError
from model.training import compiled_step
from tests.train.helpers import counting_documents, write_ids_corpus
from tests.train.test_train import _argv


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "count.ids"
  write_ids_corpus(path, counting_documents(300, seed=0))
  return path


@pytest.fixture(scope="module")
def step_file(corpus, tmp_path_factory):
  """The run's step compiled by model/aot.py on this CPU's one device and written as kda-aot-compile does."""
  cfg = load_config(_argv(corpus, tmp_path_factory.mktemp("unused"), "steps=3"))
  mesh = partitioning.create_mesh(cfg, jax.devices()[:1])
  lowered, _ = aot.lower(cfg, "train", mesh)
  path = tmp_path_factory.mktemp("aot") / "train_step.bin"
  head = compiled_step.header(cfg, jax.devices()[0].device_kind, 1, partitioning.mesh_shape(cfg, 1))
  size = compiled_step.save(path, lowered.compile(), head)
  assert size == path.stat().st_size and not list(path.parent.glob(".*.tmp"))
  return path


def _losses(out) -> list[float]:
  recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in recs if "loss" in r]


def test_the_loaded_step_trains_as_the_compiled_one(corpus, step_file, tmp_path, capsys):
  import tools.train as train_tool
  assert train_tool.main(_argv(corpus, tmp_path / "aot", "steps=3", f"compiled_trainstep_file={step_file}")) == 0
  err = capsys.readouterr().err
  assert f"loading the train step compiled ahead of time from {step_file}" in err, err
  ready = [ln for ln in err.splitlines() if ln.startswith("train step ready in ")]
  assert len(ready) == 1 and f"(loaded from {step_file})" in ready[0], err
  assert "compiling the train step" not in err
  assert train_tool.main(_argv(corpus, tmp_path / "jit", "steps=3")) == 0
  got, want = _losses(tmp_path / "aot"), _losses(tmp_path / "jit")
  assert len(got) == len(want) == 3
  # The same program (traced under a one-device mesh ahead of time, without one here): equal losses.
  assert got == want


def test_a_file_for_another_step_is_refused_before_anything_is_written(corpus, step_file, tmp_path):
  from model.training import trainer
  out = tmp_path / "run"
  cfg = load_config(_argv(corpus, out, "steps=3", "learning_rate=1e-3", "batch_size=2",
                          f"compiled_trainstep_file={step_file}"))
  with pytest.raises(UsageError) as e:
    trainer.train(cfg, progress=False)
  msg = str(e.value)
  assert msg.startswith(f"compiled_trainstep_file={step_file} was compiled for another step: "), msg
  assert "batch_size=4 in the file, 2 in this run" in msg and "learning_rate=0.003 in the file, 0.001 in this run" in msg
  assert msg.endswith("compile it again with this run's keys (kda-aot-compile ... mode=train "
                      "compiled_trainstep_file=...) or drop compiled_trainstep_file"), msg
  assert not out.exists()
  # Keys outside the step (data, run directory, logging) may differ.
  cfg = load_config(_argv(corpus, out, "steps=3", "log_every=2", "data_seed=5", f"compiled_trainstep_file={step_file}"))
  compiled_step.check(step_file, compiled_step.read(step_file), trainer.step_header(cfg))


def test_a_damaged_executable_is_one_clear_error(step_file, tmp_path):
  cut = tmp_path / "cut.bin"
  cut.write_bytes(step_file.read_bytes()[:-1000])
  assert compiled_step.read(cut) == compiled_step.read(step_file)   # the header alone is intact
  with pytest.raises(UsageError, match=rf"^compiled_trainstep_file={cut}: the executable is damaged \("):
    compiled_step.deserialize(cut, "cpu")


def test_a_file_that_is_not_a_compiled_step_is_one_clear_error(corpus, tmp_path):
  import tools.train as train_tool
  bad = tmp_path / "bad.bin"
  bad.write_bytes(b"not a compiled step")
  with pytest.raises(UsageError, match=rf"^compiled_trainstep_file={bad} is not a compiled train step \(written by "):
    compiled_step.read(bad)
  with pytest.raises(UsageError, match=r"no such file \(write one with kda-aot-compile ... mode=train "):
    compiled_step.read(tmp_path / "missing.bin")
  assert train_tool.main(_argv(corpus, tmp_path / "run", f"compiled_trainstep_file={bad}")) == 2
  assert not (tmp_path / "run").exists()
  with pytest.raises(UsageError, match=rf"^compiled_trainstep_file={tmp_path} is a directory: "):
    compiled_step.read(tmp_path)
  # The right magic line, then a header that is not one (a new user's hand-made files): one line each.
  import json
  import struct

  def made(name, head: bytes, length=None):
    path = tmp_path / name
    path.write_bytes(compiled_step.MAGIC + struct.pack("<Q", len(head) if length is None else length) + head)
    return path
  for path, why in ((made("no_keys.bin", b'{"format": 1}'), "its header lacks or mistypes jax, jaxlib"),
                    (made("list.bin", json.dumps({"format": 1, "jax": "x", "jaxlib": "x", "device_kind": "cpu",
                                                  "num_devices": 1, "mesh": {}, "config": []}).encode()),
                     "its header lacks or mistypes config"),
                    (made("long.bin", b"{}", length=2**63 - 1), "its header length 9223372036854775807 exceeds")):
    with pytest.raises(UsageError, match=rf"^compiled_trainstep_file={path} is not a compiled train step: {why}"):
      compiled_step.read(path)


def test_aot_compile_writes_the_step_for_mode_train_only(tmp_path, capsys):
  from tools import aot_compile
  assert aot_compile.main(["tiny", "compile_topology=v5e:1x1", "mode=decode",
                           f"compiled_trainstep_file={tmp_path / 'x.bin'}"]) == 2
  assert "error: compiled_trainstep_file is written for mode=train only, got mode=decode" in capsys.readouterr().err
  existing = tmp_path / "x.bin"
  existing.write_bytes(b"")
  assert aot_compile.main(["tiny", "compile_topology=v5e:1x1", f"compiled_trainstep_file={existing}"]) == 2
  assert "compiled_trainstep_file" in capsys.readouterr().err
  # The optimizer's keys are checked as kda-train checks them (was: optax's traceback inside tracing).
  assert aot_compile.main(["tiny", "compile_topology=v5e:1x1", "mode=train", "steps=3"]) == 2
  assert "error: warmup_steps=100 is invalid: expected fewer than steps=3" in capsys.readouterr().err
