"""The decode-time paths of the model that serving relies on, against NumPy float64 oracles:
MLA decode in absorbed form (scores and outputs against the cached latents) and the MoE path that
gathers only the routed experts when fewer (token, expert) pairs than experts are routed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ModelArgs, load_config
from model.nn.mla import MultiHeadLatentAttention
from model.nn.moe import Experts

ARGS = ModelArgs.from_config(load_config(["tiny", "num_experts=8", "num_experts_per_tok=2", "moe_intermediate_size=12"]))


def _mla_oracle(m: MultiHeadLatentAttention, x, cache, lengths):
  """Expanded (textbook) MLA decode in float64: keys/values re-expanded for every cached token."""
  f = lambda a: np.asarray(a, np.float64)
  wq, wa, wb, wo = (f(p.kernel[...]) for p in (m.q_proj, m.kv_a_proj_with_mqa, m.kv_b_proj, m.o_proj))
  norm = f(m.kv_a_layernorm.scale[...])
  r, nh, dn, dr, dv = m.rank, m.num_heads, m.dn, m.dr, m.dv
  out, new_cache = [], f(cache).copy()
  for s in range(x.shape[0]):
    xs = f(x[s])
    c = xs @ wa
    ckv = c[:r] / np.sqrt(np.mean(c[:r] ** 2) + m.kv_a_layernorm.eps) * norm
    new_cache[s, lengths[s]] = np.concatenate([ckv, c[r:]])
    lat = new_cache[s, :lengths[s] + 1]                                   # [l, r + dr]
    kv = (lat[:, :r] @ wb).reshape(-1, nh, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(lat[:, None, r:], (lat.shape[0], nh, dr))], -1)
    q = (xs @ wq).reshape(nh, dn + dr)
    sc = np.einsum("hd,lhd->hl", q, k) * (dn + dr) ** -0.5
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out.append(np.einsum("hl,lhd->hd", p, kv[..., dn:]).reshape(-1) @ wo)
  return np.array(out), new_cache


def test_mla_absorbed_decode_matches_expanded_oracle():
  with nnx.use_eager_sharding(False):  # as KimiLinearForCausalLM builds its modules
    m = MultiHeadLatentAttention(ARGS, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(0)
  s, length = 3, 10
  x = rng.normal(0, 1, (s, ARGS.hidden_size)).astype(np.float32)
  cache = rng.normal(0, 1, (s, length, m.latent_width)).astype(np.float32)
  lengths = np.array([0, 4, 9], np.int32)            # an empty sequence, a middle one, a full cache
  y, new = m.decode_latent(jnp.asarray(x), jnp.asarray(cache), jnp.asarray(lengths))
  want_y, want_cache = _mla_oracle(m, x, cache, lengths)
  np.testing.assert_allclose(np.asarray(y), want_y, atol=2e-6, rtol=0)
  np.testing.assert_allclose(np.asarray(new), want_cache, atol=2e-6, rtol=0)


@pytest.mark.parametrize("tokens", [1, 3, 5])    # 2, 6 pairs < 8 experts: gathered; 10 pairs: dense
def test_moe_experts_match_oracle(tokens):
  with nnx.use_eager_sharding(False):
    ex = Experts(ARGS, nnx.Rngs(5))
  rng = np.random.default_rng(tokens)
  x = rng.normal(0, 1, (tokens, ARGS.hidden_size)).astype(np.float32)
  idx = np.stack([rng.choice(8, 2, replace=False) for _ in range(tokens)]).astype(np.int32)
  w = rng.uniform(0.1, 1.0, (tokens, 2)).astype(np.float32)
  got = np.asarray(ex(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx)))
  w1, w3, w2 = (np.asarray(p[...], np.float64) for p in (ex.w1, ex.w3, ex.w2))
  silu = lambda a: a / (1 + np.exp(-a))
  want = np.zeros((tokens, ARGS.hidden_size))
  for n in range(tokens):
    for j in range(2):
      e = idx[n, j]
      want[n] += w[n, j] * ((silu(x[n] @ w1[e]) * (x[n] @ w3[e])) @ w2[e])
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
