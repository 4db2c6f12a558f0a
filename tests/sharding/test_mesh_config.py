"""Mesh and sharding configuration (one device, in process): impossible meshes fail at config time
with clear errors, the rules parse, and every model hook is the identity outside a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from model import partitioning
from model.nn import cache as cache_lib
from model.config import ConfigError, load_config

HEADS8 = ("kda_num_heads=8", "num_attention_heads=8", "num_experts=8")


def cfg(*overrides):
  return load_config(["tiny", *overrides])


@pytest.mark.parametrize("keys, shape", [
    (("ici_data_parallelism=8",), (8, 1, 1, 1)),
    (("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"), (2, 2, 1, 2)),
    (("ici_data_parallelism=1", "ici_tensor_parallelism=8"), (1, 1, 1, 8)),
    (("ici_data_parallelism=2", "ici_expert_parallelism=4"), (2, 1, 4, 1)),
    (("ici_data_parallelism=-1", "ici_tensor_parallelism=2", "ici_expert_parallelism=2"), (2, 1, 2, 2)),
    (("ici_data_parallelism=1", "ici_fsdp_parallelism=-1"), (1, 8, 1, 1)),
])
def test_mesh_shape_resolves_the_rest_axis(keys, shape):
  assert tuple(partitioning.mesh_shape(cfg(*HEADS8, *keys), 8).values()) == shape


@pytest.mark.parametrize("keys, devices, message", [
    (("ici_data_parallelism=3",), 8, r"multiply to 3 but there are 8 devices"),
    (("ici_data_parallelism=2", "ici_tensor_parallelism=2"), 8, r"multiply to 4 but there are 8 devices"),
    (("ici_data_parallelism=-1", "ici_fsdp_parallelism=3"), 8, r"multiply to 3, which does not divide the 8 devices"),
    (("ici_data_parallelism=1", "ici_tensor_parallelism=-1"), 16, r"kda_num_heads=8 is not divisible by 16"),
])
def test_impossible_device_counts_fail_with_the_keys_named(keys, devices, message):
  c = cfg(*HEADS8, *keys)
  with pytest.raises(ConfigError, match=message):
    partitioning.mesh_shape(c, devices)


def test_one_device_still_checks_the_mesh_keys():
  one = jax.devices()[:1]
  assert partitioning.job_mesh(cfg(), one) is None
  assert partitioning.job_mesh(cfg("ici_data_parallelism=-1"), one) is None
  with pytest.raises(ConfigError, match=r"ici_data_parallelism=2.* multiply to 2 but there are 1 devices"):
    partitioning.job_mesh(cfg("ici_data_parallelism=2"), one)


def test_heads_not_divisible_by_the_tensor_axis_fail_at_load_config():
  # tiny has 2 KDA and 2 MLA heads: a tensor axis of 4 cannot hold whole heads.
  with pytest.raises(ConfigError, match=r"kda_num_heads=2 is not divisible by 4.*ici_tensor_parallelism=4"):
    cfg("ici_tensor_parallelism=4")
  with pytest.raises(ConfigError, match=r"num_attention_heads=2 is not divisible by 4"):
    cfg("kda_num_heads=4", "ici_tensor_parallelism=4")
  # ... also when the tensor axis is the -1 one, as soon as the device count is known.
  c = cfg("ici_data_parallelism=1", "ici_tensor_parallelism=-1")
  with pytest.raises(ConfigError, match=r"kda_num_heads=2 is not divisible by 8"):
    partitioning.mesh_shape(c, 8)


def test_experts_not_divisible_by_the_expert_axis_fail_at_load_config():
  with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by 3.*ici_expert_parallelism=3"):
    cfg("ici_expert_parallelism=3")


MEGABLOX_ON_A_MESH = (r"^moe_impl=megablox needs one device: its Pallas TPU grouped matmul cannot be split over a "
                      r"mesh, and this job's mesh has {} devices \({}\); use moe_impl=auto \(dense on a mesh\), "
                      r"dense or ragged, or set those keys to 1$")


def test_megablox_on_a_mesh_of_several_devices_is_refused_up_front():
  """Its Pallas kernel cannot be partitioned by GSPMD (on a TPU the compile failed deep inside Mosaic:
  "cannot be automatically partitioned"): refused, naming moe_impl and what to use, as soon as the
  mesh is known: at load_config when the sizes say it, else where the devices resolve the -1 axis."""
  every = MEGABLOX_ON_A_MESH.format(8, r"ici_data_parallelism=-1 \(the devices left: 8\)")
  with pytest.raises(ConfigError, match=every):
    partitioning.mesh_shape(cfg("moe_impl=megablox"), 8)   # the default ici_data_parallelism=-1: all 8
  two_keys = MEGABLOX_ON_A_MESH.format(4, "ici_data_parallelism=2, ici_expert_parallelism=2")
  with pytest.raises(ConfigError, match=two_keys):
    cfg("moe_impl=megablox", "ici_data_parallelism=2", "ici_expert_parallelism=2")   # at config time
  with pytest.raises(ConfigError, match=MEGABLOX_ON_A_MESH.format(2, "ici_tensor_parallelism=2")):
    cfg("moe_impl=megablox", "ici_data_parallelism=1", "ici_tensor_parallelism=2")
  with pytest.raises(ConfigError, match=MEGABLOX_ON_A_MESH.format("at least 2", "ici_expert_parallelism=2")):
    cfg("moe_impl=megablox", "ici_expert_parallelism=2")   # data=-1 still open: at least 2 devices
  with pytest.raises(ConfigError, match=MEGABLOX_ON_A_MESH.format(2, "dcn_data_parallelism=2")):
    cfg("moe_impl=megablox", "ici_data_parallelism=1", "dcn_data_parallelism=2")   # two slices
  with pytest.raises(ConfigError, match="moe_impl=megablox needs one device"):   # the job's mesh builders
    partitioning.create_mesh(cfg("moe_impl=megablox"), jax.devices() * 8)
  with pytest.raises(ConfigError, match="moe_impl=megablox needs one device"):
    partitioning.job_mesh(cfg("moe_impl=megablox"), jax.devices() * 2)
  # The other implementations run on any mesh; `auto` is dense there.
  for impl in ("auto", "dense", "ragged"):
    assert partitioning.mesh_shape(cfg(f"moe_impl={impl}"), 8)["data"] == 8


def test_megablox_on_one_device_is_unchanged():
  one = jax.devices()[:1]
  c = cfg("moe_impl=megablox")
  assert partitioning.mesh_shape(c, 1) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
  assert partitioning.job_mesh(c, one) is None
  assert partitioning.create_mesh(c, one).size == 1
  assert cfg("moe_impl=megablox", "ici_data_parallelism=1").moe_impl == "megablox"


def test_rules_that_move_heads_are_checked_too():
  with pytest.raises(ConfigError, match=r"kda_num_heads=2 is not divisible by 4.*'heads'"):
    cfg("ici_data_parallelism=4", "logical_axis_rules=[heads:data]")


@pytest.mark.parametrize("keys, message", [
    (("ici_data_parallelism=-1", "ici_fsdp_parallelism=-1"), r"at most one mesh axis may be -1"),
    (("ici_tensor_parallelism=0",), r"ici_tensor_parallelism must be a positive int or -1 \(every device left\), got 0"),
    (("logical_axis_rules=[heads-tensor]",), r"must be written 'logical:axis\+axis'"),
    (("logical_axis_rules=[heads:tensr]",), r"unknown mesh axes \['tensr'\]"),
    (("logical_axis_rules=[head:tensor]",), r"unknown logical axis 'head'"),
    (("logical_axis_rules=[heads:tensor,heads:data]",), r"'heads' more than once"),
    (("logical_axis_rules=[activation_batch:data+data]",), r"uses a mesh axis twice"),
    (("num_processes=2", "process_id=2"), r"process_id=2 must be < num_processes=2"),
])
def test_bad_mesh_keys_fail_at_load_config(keys, message):
  with pytest.raises(ConfigError, match=message):
    cfg(*keys)


def test_create_mesh_checks_the_real_device_count():
  with pytest.raises(ConfigError, match=r"multiply to 2 but there are 1 devices"):
    partitioning.create_mesh(cfg("ici_data_parallelism=2"))
  mesh = partitioning.create_mesh(cfg())
  assert mesh.axis_names == partitioning.MESH_AXES and mesh.size == 1


def test_rules_parse_to_flax_format_with_every_logical_axis():
  rules = partitioning.parse_logical_axis_rules(["activation_batch:data+fsdp", "heads:tensor", "kv:", "vocab:none"])
  table = dict(rules)
  assert [name for name, _ in rules] == list(partitioning.LOGICAL_AXES)
  assert table["activation_batch"] == ("data", "fsdp") and table["heads"] == "tensor"
  assert table["kv"] is None and table["vocab"] is None and table["embed"] is None  # unlisted: replicated
  assert partitioning.logical_to_spec(("activation_batch", None, "heads"), rules) == P(("data", "fsdp"), None, "tensor")
  with pytest.raises(ValueError, match="'nope' has no sharding rule"):
    partitioning.logical_to_spec(("nope",), rules)


def test_default_rules_match_the_issue():
  table = dict(partitioning.default_rules())
  assert table["activation_batch"] == ("data", "fsdp")
  assert table["heads"] == table["activation_heads"] == "tensor"
  assert table["expert"] == "expert" and table["embed"] == "fsdp"


def test_undividable_dimensions_are_replicated():
  mesh = AbstractMesh((2, 2, 1, 2), partitioning.MESH_AXES)
  axes = ("activation_batch", None, "activation_heads")
  assert partitioning.fitted_spec(axes, (4, 3, 2), mesh) == P(("data", "fsdp"), None, "tensor")
  assert partitioning.fitted_spec(axes, (2, 3, 2), mesh) == P("data", None, "tensor")  # longest prefix that divides
  assert partitioning.fitted_spec(axes, (1, 3, 3), mesh) == P(None, None, None)


def test_hooks_are_the_identity_outside_a_mesh():
  x = jnp.arange(6.0).reshape(2, 3)
  assert partitioning.constrain(x, partitioning.DECODE_HIDDEN) is x
  calls = []
  out = partitioning.per_shard(lambda a, b, none: calls.append(none) or (a + b,), (x, x, None),
                           in_axes=(partitioning.DECODE_HIDDEN,) * 3, out_axes=(partitioning.DECODE_HIDDEN,))
  np.testing.assert_array_equal(out[0], 2 * x)
  assert calls == [None]
  one_device = partitioning.create_mesh(cfg())
  with partitioning.mesh_context(one_device, cfg()):  # a 1-device mesh changes nothing either
    assert partitioning.constrain(x, partitioning.DECODE_HIDDEN) is x


def test_cache_axes_follow_the_cache_tree():
  from model.nn.kimi_linear import KimiLinearForCausalLM
  from flax import nnx
  model = nnx.eval_shape(lambda: KimiLinearForCausalLM(cfg()))
  cache = jax.eval_shape(lambda: model.init_cache(2, 3, 8))
  axes = cache_lib.logical_axes(cache)
  assert axes.layers[0].state == partitioning.STATE_SHKV and axes.layers[1].latent[0] == "activation_batch"
  assert jax.tree.structure(cache_lib.shardings(cache, partitioning.create_mesh(cfg()))) == jax.tree.structure(cache)


def test_distributed_start_up_is_off_by_default():
  assert partitioning.initialize_distributed(cfg()) is False
