"""`blocked_nll` (the training loss, one checkpointed block of tokens at a time) equals `masked_nll`
on the whole logits, in value and in gradient, whatever the block size (a block per position, blocks
that do not divide T, one block)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.training.steps import blocked_nll, masked_nll

B, T, D, VOCAB = 3, 37, 8, 50


def _case():
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(D, VOCAB)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, size=(B, T)), jnp.int32)
  mask = jnp.asarray(rng.uniform(size=(B, T)) < 0.8)
  return hidden, kernel, targets, mask


@pytest.mark.parametrize("block_tokens", [1, 3 * 5, 3 * 10, B * T, 10_000])
def test_blocked_nll_equals_the_whole_loss(block_tokens):
  hidden, kernel, targets, mask = _case()

  def whole(h, w):
    return masked_nll(h @ w, targets, mask)

  def blocked(h, w):
    return blocked_nll(lambda x: x @ w, h, targets, mask, block_tokens=block_tokens)

  (want, want_n), (got, got_n) = whole(hidden, kernel), jax.jit(blocked)(hidden, kernel)
  assert float(got_n) == float(want_n) == float(np.sum(np.asarray(mask)))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  gw = jax.grad(lambda h, w: whole(h, w)[0], argnums=(0, 1))(hidden, kernel)
  gb = jax.jit(jax.grad(lambda h, w: blocked(h, w)[0], argnums=(0, 1)))(hidden, kernel)
  for a, b in zip(gb, gw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
