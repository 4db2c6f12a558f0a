"""scan_layers=true (model/nn/scan.py) computes what the unrolled model computes, on the 48B layer
pattern at tiny widths (configs/kimi_linear_48b_pattern_small.py: the scan runs six times over
layers 2-25), with the same per-layer parameters; remat_policy changes no value or gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ConfigError, load_config
from model.nn import scan as scan_lib
from model.nn.kimi_linear import KimiLinearForCausalLM

CONFIG = "kimi_linear_48b_pattern_small"


def _pair(*overrides):
  cfg = load_config([CONFIG, *overrides])
  unrolled = KimiLinearForCausalLM(cfg)
  scanned = KimiLinearForCausalLM(load_config([CONFIG, "scan_layers=true", *overrides]))
  nnx.update(scanned, nnx.state(unrolled))
  return cfg, unrolled, scanned


def _batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  b, t = 2, 24
  ids = rng.integers(3, cfg.vocab_size, (b, t)).astype(np.int32)
  seg = np.ones((b, t), np.int32)
  seg[0, 10:] = 2
  seg[1, 20:] = 0  # padding
  return jnp.asarray(ids), jnp.asarray(seg)


def test_plan_of_the_48b_pattern():
  cfg = load_config([CONFIG])
  sig = [("kda" if i in cfg.kda_layers else "mla", i > cfg.first_k_dense_replace)
         for i in range(1, cfg.num_hidden_layers + 1)]
  # Layers 2..25 (0-indexed 1..24): six groups of KDA, KDA, MLA, KDA (all MoE) -- the six KDA x3 + MLA
  # groups of layers 1-24 shifted by one, so that layer 1 (dense FFN) is left out and 24 layers scan;
  # layers 1, 26 (KDA) and 27 (MLA) run unrolled.
  assert scan_lib.scan_plan(sig) == (1, 4, 6)
  assert scan_lib.scan_plan(["a", "b", "c"]) is None


def _same_in_float32(got, want):
  """The scanned and the unrolled programs are the same float32 math, but XLA may order some sums
  differently in the scan body than in the unrolled layers: with jax 0.12.1 (not 0.12.0) the logits
  differ by 1.04e-6 (27-layer forward) and 1.37e-6 (5-layer prefill) at a largest |logit| of ~1, bit for
  bit equal before. The bound is 32 float32 ulps of the largest value compared (~3.8e-6 here), far
  below what any difference in the math (a bf16 rounding, a wrong layer) would give (>= 1e-3)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=32 * np.finfo(np.float32).eps * max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("mode", ["train", pytest.param("eval", marks=pytest.mark.slow)])
def test_scanned_forward_equals_unrolled(mode):
  cfg, unrolled, scanned = _pair()
  ids, seg = _batch(cfg)
  # Both jitted: XLA compiles each whole forward, so the comparison is scan against unrolled, not
  # one compiled program against op-by-op dispatch (which fuses differently).
  fwd = nnx.jit(lambda m, i, s: m(i, s, mode=mode))
  want = np.asarray(fwd(unrolled, ids, seg), np.float64)
  got = np.asarray(fwd(scanned, ids, seg), np.float64)
  assert np.abs(want).max() > 0.1  # real logits, not zeros
  _same_in_float32(got, want)


# 5 layers, the smallest pattern whose scan runs twice over groups holding both mixers with their
# caches (dense KDA, then KDA, MLA twice): the 27-layer forward above checks the 48B plan itself, and
# these programs (jitted backward, prefill and decode, each compiled twice) stay small on the CPU
# test host (the 9-layer pattern's remat gradients compiled in 13.6 + 10.9 s).
FIVE_LAYERS = ("num_hidden_layers=5", "full_attn_layers=[3,5]", "kda_layers=[1,2,4]")


def test_scanned_prefill_and_decode_equal_unrolled():
  cfg, unrolled, scanned = _pair(*FIVE_LAYERS)
  assert scanned.scan_plan() == (1, 2, 2)
  ids, seg = _batch(cfg, seed=1)
  prefill = nnx.jit(lambda m, i, s: m.prefill(i, s, num_slots=2, cache_length=32))
  (lw, cw), (lg, cg) = prefill(unrolled, ids, seg), prefill(scanned, ids, seg)
  _same_in_float32(lg, lw)
  for a, b in zip(jax.tree.leaves(cw), jax.tree.leaves(cg)):
    _same_in_float32(b, a)
  nxt = jnp.arange(4, dtype=jnp.int32) + 5
  decode = nnx.jit(lambda m, i, c: m.decode(i, c))
  (dw, _), (dg, _) = decode(unrolled, nxt, cw), decode(scanned, nxt, cg)
  _same_in_float32(dg, dw)


@pytest.mark.parametrize("policy", ["full", pytest.param("minimal", marks=pytest.mark.slow)])
def test_remat_policy_keeps_loss_and_gradients(policy):
  cfg, unrolled, scanned = _pair(f"remat_policy={policy}", *FIVE_LAYERS)
  assert scanned.scan_plan() == (1, 2, 2)
  ids, seg = _batch(cfg, seed=2)

  def loss(model):
    logits = model(ids, seg, mode="train").astype(jnp.float32)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (seg > 0))

  lw, gw = jax.jit(nnx.value_and_grad(loss))(unrolled)
  lg, gg = jax.jit(nnx.value_and_grad(loss))(scanned)
  np.testing.assert_allclose(float(lg), float(lw), rtol=0, atol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(gw)), jax.tree.leaves(nnx.state(gg))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)


def test_unknown_remat_policy_names_the_key():
  with pytest.raises(ConfigError, match="remat_policy must be one of none, full"):
    load_config([CONFIG, "remat_policy=everything"])


def _stack_free_programs(scanned, ids, seg):
  """prefill + decode of `scanned` with its scanned layers' parameters stacked outside the program
  (`split_stacked`), run under `prestacked_groups`: the jitted functions take `(rest, stacked)`."""
  graphdef, state = nnx.split(scanned)
  plan = scanned.scan_plan()
  rest, stacked = scan_lib.split_stacked(state, plan)

  def prefill(rest, stacked, i, s):
    with scan_lib.prestacked_groups(stacked):
      return nnx.merge(graphdef, scan_lib.merge_stacked(rest, stacked, plan)).prefill(
          i, s, num_slots=2, cache_length=32)

  def decode(rest, stacked, i, c):
    with scan_lib.prestacked_groups(stacked):
      return nnx.merge(graphdef, scan_lib.merge_stacked(rest, stacked, plan)).decode(i, c)

  return rest, stacked, jax.jit(prefill), jax.jit(decode)


@pytest.mark.slow  # four jitted 27-layer programs: minutes on the shared 2-core host
def test_prestacked_parameters_give_the_same_prefill_and_decode_without_stacking_in_the_program():
  cfg, unrolled, scanned = _pair()
  ids, seg = _batch(cfg, seed=3)
  rest, stacked, prefill, decode = _stack_free_programs(scanned, ids, seg)
  start, period, repeats = scanned.scan_plan()
  # Layer start + g * period + j is row g of position j's stacked leaves.
  want_row = nnx.state(scanned.model.layers[start + 2 * period + 1])
  for a, b in zip(jax.tree.leaves(stacked[1]), jax.tree.leaves(want_row)):
    np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b))
  (lw, cw) = nnx.jit(lambda m, i, s: m.prefill(i, s, num_slots=2, cache_length=32))(unrolled, ids, seg)
  lg, cg = prefill(rest, stacked, ids, seg)
  _same_in_float32(lg, lw)
  for a, b in zip(jax.tree.leaves(cw), jax.tree.leaves(cg)):
    _same_in_float32(b, a)
  nxt = jnp.arange(4, dtype=jnp.int32) + 5
  dw, _ = nnx.jit(lambda m, i, c: m.decode(i, c))(unrolled, nxt, cw)
  dg, _ = decode(rest, stacked, nxt, cg)
  _same_in_float32(dg, dw)
  # The point of it: the program no longer concatenates the parameters into [repeats, ...] arrays
  # (the in-trace stack shows up as concatenates of exactly those shapes).
  stacked_shapes = {tuple(a.shape) for a in jax.tree.leaves(stacked)}

  def stacking_ops(jitted, *args):
    text = jitted.lower(*args).as_text()
    return [ln for ln in text.splitlines() if "concatenate" in ln
            and any(f"tensor<{'x'.join(map(str, s))}x" in ln.split("->")[-1] for s in stacked_shapes)]

  plain = jax.jit(lambda m, i, s: m.prefill(i, s, num_slots=2, cache_length=32))
  assert stacking_ops(plain, scanned, ids, seg)  # the oracle: the in-trace stack is visible
  assert not stacking_ops(prefill, rest, stacked, ids, seg)


@pytest.mark.slow  # runs layer 1 eagerly before the check: ~2 minutes on the shared host
def test_prestacked_groups_checks_the_shapes():
  cfg, _, scanned = _pair()
  _, state = nnx.split(scanned)
  plan = scanned.scan_plan()
  _, stacked = scan_lib.split_stacked(state, plan)
  short = [jax.tree.map(lambda a: a[:-1], st) for st in stacked]
  ids, seg = _batch(cfg)
  with scan_lib.prestacked_groups(short), pytest.raises(ValueError, match="expected \\(6,"):
    scanned.prefill(ids, seg, num_slots=2, cache_length=32)
