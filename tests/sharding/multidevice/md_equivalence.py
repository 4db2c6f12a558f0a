"""8 simulated devices: train step, packed prefill and greedy generation on each acceptance mesh
equal the one-device results (float32, 1e-5), and the mesh really shards what the rules say.

Run by tests/sharding/test_multidevice.py (in a subprocess: the device count is fixed per process).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import loading, partitioning
from model.nn.kimi_linear import KimiLinearForCausalLM
from tests.sharding.multidevice import common as c

c.require_devices()


@pytest.fixture(scope="module")
def model_and_batch():
  model = KimiLinearForCausalLM(c.config(*c.ONE_DEVICE))
  graphdef, state = nnx.split(model)
  ids, seg = c.packed_batch()
  return graphdef, state, ids, seg


@pytest.fixture(scope="module")
def reference(model_and_batch):
  """One device, no mesh context: the plain model."""
  graphdef, state, ids, seg = model_and_batch
  one = jax.devices()[0]
  out = c.run_all(graphdef, jax.device_put(state, one), jax.device_put(ids, one), jax.device_put(seg, one))
  return jax.tree.map(np.asarray, out)


@pytest.fixture(scope="module", params=list(c.MESHES))
def sharded(request, model_and_batch):
  """The same parameters and batch placed on a mesh, every program traced in its context."""
  graphdef, state, ids, seg = model_and_batch
  cfg = c.config(*c.MESHES[request.param])
  mesh = partitioning.create_mesh(cfg)
  _, abstract = loading.abstract_state(cfg, mesh)
  state = jax.device_put(state, partitioning.state_shardings(abstract))
  batch = partitioning.batch_sharding(mesh, ids.shape, rules_or_cfg=cfg)
  c.programs.cache_clear()  # a fresh trace under this mesh (the jit cache keys on the mesh too)
  with partitioning.mesh_context(mesh, cfg):
    out = c.run_all(graphdef, state, jax.device_put(ids, batch), jax.device_put(seg, batch))
  return request.param, mesh, cfg, state, out


def test_train_loss_and_gradients_match_one_device(sharded, reference):
  name, _, _, _, out = sharded
  c.assert_close(out["loss"], reference["loss"], f"{name} loss")
  got = nnx.to_flat_state(out["grads"])
  want = dict(nnx.to_flat_state(reference["grads"]))
  assert len(got) == len(want) > 20
  for path, g in got:
    c.assert_close(np.asarray(g.get_value()), np.asarray(want[path].get_value()), f"{name} grad {path}")


def test_packed_prefill_logits_and_cache_match_one_device(sharded, reference):
  name, _, _, _, out = sharded
  c.assert_close(out["logits"], reference["logits"], f"{name} prefill logits")
  for i, (a, b) in enumerate(zip(jax.tree.leaves(out["cache"]), jax.tree.leaves(reference["cache"]))):
    c.assert_close(a, b, f"{name} prefill cache leaf {i}")


def test_greedy_tokens_match_one_device(sharded, reference):
  name, _, _, _, out = sharded
  np.testing.assert_array_equal(np.asarray(out["tokens"]), reference["tokens"], err_msg=name)


# What each acceptance mesh must actually split (so the equalities above are not vacuous).
EXPECTED = {
    "data8": dict(q_proj=P(None, None), w1=P(None, None, None), logits=P("data", None, None),
                  state=P("data", None, None, None)),
    "fsdp2_tensor2_data2": dict(q_proj=P("fsdp", "tensor"), w1=P(None, "fsdp", "tensor"),
                                logits=P(("data", "fsdp"), None, "tensor"),
                                state=P(("data", "fsdp"), "tensor", None, None)),
    "tensor8": dict(q_proj=P(None, "tensor"), w1=P(None, None, "tensor"), logits=P(None, None, "tensor"),
                    state=P(None, "tensor", None, None)),
    "expert4_data2": dict(q_proj=P(None, None), w1=P("expert", None, None), logits=P("data", None, None),
                          state=P("data", None, None, None)),
}


def _norm(spec, ndim, mesh):
  """The spec without size-1 mesh axes (they split nothing), padded with None to ndim."""
  out = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if mesh.shape[a] > 1)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def test_parameters_activations_and_caches_are_split_as_the_rules_say(sharded):
  name, mesh, _, state, out = sharded
  want = EXPECTED[name]
  q = state["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
  w1 = state["model"]["layers"][1]["block_sparse_moe"]["experts"]["w1"].get_value()
  assert _norm(q.sharding.spec, 2, mesh) == want["q_proj"]
  assert _norm(w1.sharding.spec, 3, mesh) == want["w1"]
  assert _norm(out["logits"].sharding.spec, 3, mesh) == want["logits"]
  kda_state = out["cache"].layers[0].state
  assert _norm(kda_state.sharding.spec, 4, mesh) == want["state"]
  # Each device holds only its slice: e.g. on tensor8 one of the 8 KDA heads of every sequence.
  shard = kda_state.addressable_shards[0].data.shape
  expect = tuple(d // np.prod([mesh.shape[a] for a in (e if isinstance(e, tuple) else (e,)) if a])
                 for d, e in zip(kda_state.shape, tuple(want["state"])))
  assert shard == expect


def test_kda_kernel_runs_under_shard_map_per_head_shard(sharded, model_and_batch):
  """The traced forward holds a shard_map whose body sees the per-device KDA shapes."""
  name, mesh, cfg, state, _ = sharded
  graphdef, _, ids, seg = model_and_batch
  with partitioning.mesh_context(mesh, cfg):
    text = str(jax.make_jaxpr(lambda s, i, g: nnx.merge(graphdef, s)(i, g, mode="train", max_num_segments=c.N))(
        state, ids, seg))
  assert "shard_map" in text
  heads = 8 // mesh.shape["tensor"]
  rows = c.B // (mesh.shape["data"] * mesh.shape["fsdp"])
  assert f"f32[{rows},{c.T},{heads},4]" in text, f"{name}: no per-shard q of [{rows},{c.T},{heads},4] in the jaxpr"


@pytest.fixture(scope="module")
def generator_reference(model_and_batch):
  graphdef, state, _, _ = model_and_batch
  return _generate(nnx.merge(graphdef, jax.device_put(state, jax.devices()[0])), None, None)


def _generate(model, mesh, cfg):
  from model.engine.generator import Generator
  prompts = [list(range(5 + i, 9 + 2 * i)) for i in range(8)]  # 4-10 tokens each, one packed row
  gen = Generator(model, max_length=c.CACHE * 2, eos_id=None, batch_size=8, prefill_multiple=64,
                  cache_multiple=16, mesh=mesh, rules=cfg)
  results, _ = gen.generate(prompts, 5)
  return [r.token_ids for r in results]


@pytest.mark.parametrize("name", ["fsdp2_tensor2_data2", "expert4_data2"])
def test_serving_generator_on_a_mesh_matches_one_device(name, model_and_batch, generator_reference):
  """model.engine.generator.Generator(mesh=...): packed prefill of 8 prompts, decode sharded on the mesh."""
  graphdef, state, _, _ = model_and_batch
  cfg = c.config(*c.MESHES[name])
  mesh = partitioning.create_mesh(cfg)
  _, abstract = loading.abstract_state(cfg, mesh)
  model = nnx.merge(graphdef, jax.device_put(state, partitioning.state_shardings(abstract)))
  assert _generate(model, mesh, cfg) == generator_reference


def _train_two_steps(cfg, ids, seg, mesh=None):
  """Two steps of model.training.steps's jitted AdamW step (the project's train step) from its
  `create_train_state` (random init from cfg.init_seed; placed on `mesh` when given)."""
  from model.training import steps as train_lib
  hparams = train_lib.optimizer_hparams(cfg)
  graphdef, tstate = train_lib.create_train_state(cfg, hparams, mesh)
  step = train_lib.train_step_fn(graphdef, hparams, c.N)
  targets = np.concatenate([ids[:, 1:], ids[:, :1]], 1)
  mask = np.concatenate([(seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), np.zeros((c.B, 1), bool)], 1)
  batch = dict(inputs=ids, targets=targets, loss_mask=mask, segment_ids=seg)
  losses = []
  for _ in range(2):
    tstate, metrics = step(tstate, batch)
    losses.append(metrics["loss"])
  return tstate, losses


@pytest.mark.slow   # two AdamW steps compiled for the mesh and for one device: `make test-slow`
def test_train_lib_step_on_a_mesh_matches_one_device(model_and_batch):
  """model.training.steps.train_step_fn traced in the mesh context on sharded parameters: the same
  losses and updated parameters as on one device, and the parameters keep their shardings.

  adam_eps=1e-3: with the default 1e-8, AdamW's update m / (sqrt(v) + eps) is ill-conditioned for
  gradient entries near eps (this batch has w1 gradients of 1.9e-8 next to 1.5e-3), where it turns
  float32 reduction-order noise of the gradients (within 1e-5, checked above) into 1e-5 parameter
  differences after two steps. A larger eps keeps the update a smooth function of the gradient."""
  _, _, ids, seg = model_and_batch
  lr = ("learning_rate=0.01", "warmup_steps=0", "steps=10", "adam_eps=1e-3")
  cfg1 = c.config(*c.ONE_DEVICE, *lr)
  with jax.default_device(jax.devices()[0]):
    want_state, want_losses = _train_two_steps(cfg1, ids, seg)
  cfg = c.config(*c.MESHES["fsdp2_tensor2_data2"], *lr)
  mesh = partitioning.create_mesh(cfg)
  _, abstract = loading.abstract_state(cfg, mesh)
  shardings = partitioning.state_shardings(abstract)
  batch = partitioning.batch_sharding(mesh, ids.shape, rules_or_cfg=cfg)
  from model.training import steps as train_lib
  train_lib.train_step_fn.cache_clear()  # trace anew inside the mesh context
  with partitioning.mesh_context(mesh, cfg):
    got_state, got_losses = _train_two_steps(cfg, jax.device_put(ids, batch), jax.device_put(seg, batch), mesh)
  train_lib.train_step_fn.cache_clear()
  for a, b in zip(got_losses, want_losses):
    c.assert_close(a, b, "train_lib loss")
  want = dict(nnx.to_flat_state(want_state["params"]))
  params_sharding = dict(nnx.to_flat_state(shardings))
  for path, v in nnx.to_flat_state(got_state["params"]):
    c.assert_close(np.asarray(v.get_value()), np.asarray(want[path].get_value()), f"param {path} after 2 steps")
    assert v.get_value().sharding.is_equivalent_to(params_sharding[path].get_value(), v.get_value().ndim), path
  mu = [x for x in jax.tree.leaves(got_state["opt_state"]) if x.ndim == 2]  # AdamW moments follow the params
  assert mu and all(len(x.sharding.device_set) == c.DEVICES and not x.sharding.is_fully_replicated for x in mu)
