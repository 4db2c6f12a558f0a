"""Auxiliary-loss-free MoE load balancing (router_bias_update_rate): one training step's bias update
against a NumPy oracle of the routing counts and the sign rule, the imbalance falling from a skewed
start (versus rate 0), the bias kept out of the optimizer, and exact resume with balancing on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.nn import moe
from model.training import steps as train_lib
from tests.train.helpers import counting_documents, tiny_config, write_ids_corpus
from model.training.trainer import _tokenizer, build_data, train

RATE = 0.005  # one rate for every test here: one compilation of the balancing step per worker


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "count.ids"
  write_ids_corpus(path, counting_documents(300, seed=0))
  # remat_policy=none: `_router_input` reads the MoE input eagerly, which a rematerialised layer traces.
  cfg = tiny_config(path, tmp_path_factory.mktemp("run") / "out", "steps=20", "remat_policy=none")
  it, _ = build_data(cfg, _tokenizer(cfg))
  batches = [next(it) for _ in range(7)]
  return path, cfg, batches


def _with_bias(cfg, bias):
  """`(graphdef, state)` of the tiny model with every MoE router bias set to `bias` (float32 [E])."""
  hp = train_lib.optimizer_hparams(cfg)
  graphdef, state = train_lib.create_train_state(cfg, hp)
  model = nnx.merge(graphdef, state["params"], state["rest"])
  blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, moe.SparseMoeBlock)]
  assert len(blocks) == 1  # the two-layer tiny model: layer 1 is the MoE layer
  for b in blocks:
    b.gate.e_score_correction_bias[...] = jnp.asarray(bias, jnp.float32)
  return train_lib.init_train_state(model, hp, cfg.train_seed)


def _bias(state):
  return np.asarray(jax.tree.leaves(state["rest"])[0])


def _router_input(graphdef, state, batch, num_slots):
  """The MoE layer's input `[B*T, d]` in an eager forward (captured around SparseMoeBlock.__call__)."""
  seen = []
  real = moe.SparseMoeBlock.__call__

  def spy(self, x):
    seen.append((np.asarray(x, np.float64).reshape(-1, x.shape[-1]), np.asarray(self.gate.kernel[...], np.float64)))
    return real(self, x)
  moe.SparseMoeBlock.__call__ = spy
  try:
    model = nnx.merge(graphdef, state["params"], state["rest"])
    model(jnp.asarray(batch.inputs), jnp.asarray(batch.segment_ids), mode="train", max_num_segments=num_slots)
  finally:
    moe.SparseMoeBlock.__call__ = real
  assert len(seen) == 1
  return seen[0]


def test_one_step_matches_a_numpy_oracle(setup):
  _, cfg, batches = setup
  rng = np.random.default_rng(0)
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  bias0 = rng.normal(0, 0.02, e).astype(np.float32)  # routing depends on the bias
  graphdef, state = _with_bias(cfg, bias0)
  batch = batches[0]
  ns = cfg.max_num_segments

  # Oracle: sigmoid scores in float64, top-k of the biased scores, counts over non-padding tokens, sign rule.
  x, kernel = _router_input(graphdef, state, batch, ns)
  choice = 1 / (1 + np.exp(-(x @ kernel))) + bias0.astype(np.float64)
  order = np.argsort(-choice, axis=1)
  top = order[:, :k]
  gap = np.take_along_axis(choice, order[:, k - 1:k], 1) - np.take_along_axis(choice, order[:, k:k + 1], 1)
  real = np.asarray(batch.segment_ids).reshape(-1) > 0
  assert gap[real].min() > 1e-5  # no near-tie: float32 routing must make the same choices
  load = np.bincount(top[real].reshape(-1), minlength=e).astype(np.float64)
  assert load.sum() == k * real.sum() and real.sum() < real.size  # padding present and not counted
  assert len(set(load.tolist())) > 1  # the batch is not balanced already: the update moves the bias
  want = bias0 + np.float32(RATE) * np.sign(load.mean() - load).astype(np.float32)

  new, metrics = train_lib.train_step_fn(graphdef, train_lib.optimizer_hparams(cfg), ns, RATE)(state, batch)
  np.testing.assert_array_equal(np.asarray(metrics["expert_load"])[0], load)
  np.testing.assert_array_equal(_bias(new), want)
  np.testing.assert_array_equal(np.asarray(train_lib.expert_load(graphdef, state, batch, ns))[0], load)

  # Not a gradient update: the parameters and optimizer state are those of the step without balancing,
  # and rate 0 leaves the bias exactly as it was.
  plain, pm = train_lib.train_step_fn(graphdef, train_lib.optimizer_hparams(cfg), ns)(state, batch)
  assert "expert_load" not in pm and float(pm["loss"]) == float(metrics["loss"])
  for a, b in zip(jax.tree.leaves((plain["params"], plain["opt_state"])), jax.tree.leaves((new["params"], new["opt_state"]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(_bias(plain), bias0)


def test_imbalance_falls_from_a_skewed_start(setup):
  """Experts 0 and 1 start with +0.05 bias (nearly every token picks them: max/mean load ~1.9). With
  balancing the bias gap closes by up to 2 * RATE per step and the imbalance falls (measured: 1.89 ->
  1.13 in 6 steps); with rate 0 the bias stays and so does the imbalance."""
  _, cfg, batches = setup
  ns, hp = cfg.max_num_segments, train_lib.optimizer_hparams(cfg)
  skew = np.array([0.05, 0.05, 0.0, 0.0], np.float32)
  probe = batches[-1]

  def imbalance(graphdef, state):
    load = np.asarray(train_lib.expert_load(graphdef, state, probe, ns))[0]
    return load.max() / load.mean()

  result = {}
  for rate in (0.0, RATE):
    graphdef, state = _with_bias(cfg, skew)
    start = imbalance(graphdef, state)
    step = train_lib.train_step_fn(graphdef, hp, ns, rate) if rate else train_lib.train_step_fn(graphdef, hp, ns)
    for batch in batches[:6]:
      state, _ = step(state, batch)
    result[rate] = (start, imbalance(graphdef, state), _bias(state))
  (s0, end0, bias0), (s1, end1, bias1) = result[0.0], result[RATE]
  assert s0 == s1 and s0 > 1.8, (s0, s1)  # the same skewed start
  np.testing.assert_array_equal(bias0, skew)
  assert end0 > 1.7, end0
  assert end1 < 1.3 and end1 < end0 - 0.4, (end1, end0)
  assert bias1[:2].max() < 0.05 and bias1[2:].min() > 0.0, bias1


# slow (about 100 s of CPU: three training runs): exact resume itself is in make test
# (tests/train/test_train.py::test_resume_matches_an_uninterrupted_run).
@pytest.mark.slow
def test_resume_with_balancing_is_exact(setup, tmp_path):
  path, _, _ = setup
  full = train(tiny_config(path, tmp_path / "full", "steps=4", "checkpoint_every=0",
                           f"router_bias_update_rate={RATE}"), progress=False)
  train(tiny_config(path, tmp_path / "split", "steps=4", "stop_at_step=2", f"router_bias_update_rate={RATE}"),
        progress=False)
  rest = train(tiny_config(path, tmp_path / "split", "steps=4", f"router_bias_update_rate={RATE}"), progress=False)
  assert rest["start_step"] == 2
  assert np.abs(_bias(full["state"])).max() > 0  # the bias moved (and was restored at step 2)
  for a, b in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(rest["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [full["losses"][s] for s in (3, 4)] == [rest["losses"][s] for s in (3, 4)]


def test_rate_must_be_finite_and_non_negative(setup):
  path, _, _ = setup
  for bad in ("-0.001", "nan", "inf"):
    with pytest.raises(train_lib.TrainError, match="router_bias_update_rate="):
      train_lib.check_train_config(tiny_config(path, "/nonexistent", f"router_bias_update_rate={bad}"))
