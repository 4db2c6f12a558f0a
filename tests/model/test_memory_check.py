"""model/memory.py through model/loading.py: a model whose parameters exceed the machine's memory is
refused in one line before anything is allocated or read (issue 17 item 2), unless allow_large_model=true."""

from __future__ import annotations

import pathlib

import jax
import pytest
from flax import nnx

from model import loading, memory
from model.config import load_config

DEMO = pathlib.Path(__file__).resolve().parents[2] / "kda_plugin" / "assets" / "demo"
GB16 = 16 * 10**9


def _host_has(monkeypatch, n):
  monkeypatch.setattr(memory, "available_memory_bytes", lambda device: (n, True))


def test_forward_check_of_the_48b_is_refused_before_allocating(monkeypatch, capsys):
  """Was: the 48B config was built at random and the kernel killed the process. Now one line with the
  parameter count and bytes against MemAvailable, exit 2; the bytes are those of the abstract state (bf16
  weights, float32 A_log/dt_bias/router), nothing is allocated (98 GB would not fit this process)."""
  from tools import forward_check
  _host_has(monkeypatch, GB16)
  assert forward_check.main(["kimi_linear_48b_a3b", "--seq", "8"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: model kimi-linear-48b-a3b has 49,122,681,728 parameters, 98.3 GB, but this host has "
                 "16.0 GB available (MemAvailable): building it would run out of memory; pass allow_large_model=true "
                 "to build it anyway, or pick a smaller config (e.g. tiny)"], err


def test_the_figures_are_the_abstract_states():
  cfg = load_config(["kimi_linear_48b_a3b"])
  count, total, held = memory.parameter_bytes(nnx.state(loading.abstract_model(cfg)), [jax.devices()[0]])
  assert count == 49_122_681_728  # model/README.md: 603 arrays, 49,122,681,728 values
  assert held == {jax.devices()[0]: total} and 2 * count <= total < 2 * count + 10**9  # bf16 + a few f32


def test_allow_large_model_builds_it_anyway(monkeypatch):
  _host_has(monkeypatch, GB16)
  big = load_config(["kimi_linear_48b_a3b"])
  state = nnx.state(loading.abstract_model(big))
  with pytest.raises(memory.ModelTooLargeError, match="allow_large_model=true"):
    loading.check_fits(big, state, None)
  loading.check_fits(load_config(["kimi_linear_48b_a3b", "allow_large_model=true"]), state, None)  # no error
  loading.check_fits(load_config(["tiny"]), nnx.state(loading.abstract_model(load_config(["tiny"]))), None)


def test_restore_is_refused_before_reading_the_checkpoint(monkeypatch):
  """The one load path checks before check_parameters reads (and checksums) every stored parameter."""
  from model.checkpoint import format as ckpt
  _host_has(monkeypatch, 10**6)
  monkeypatch.setattr(ckpt, "check_parameters", lambda *a, **k: pytest.fail("read before the memory check"))
  with pytest.raises(memory.ModelTooLargeError, match=r"^model demo has [\d,]+ parameters, [\d.]+ MB, but this host "
                     r"has 1\.0 MB available \(MemAvailable\)"):
    loading.load_model(DEMO)


def test_a_leaf_sharded_over_an_abstract_mesh_counts_whole_on_the_first_device():
  """`loading.create` inside `partitioning.mesh_context` sees shardings over an AbstractMesh (no
  devices): the eager model lands whole on one device, so that is what is counted (the 8-device
  train test hit `device_set is not implemented for AbstractMesh` before)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

  from model.memory import parameter_bytes
  mesh = AbstractMesh((2,), ("x",))
  leaf = jax.ShapeDtypeStruct((4, 6), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x")))
  dev = jax.devices()[0]
  assert parameter_bytes({"w": leaf}, [dev]) == (24, 96, {dev: 96})
