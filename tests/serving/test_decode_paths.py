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
# A latent wider than 128 columns (120 + 16): cached zero-padded to 256 (`latent_width`).
WIDE = ModelArgs.from_config(load_config(["tiny", "kv_lora_rank=120", "qk_rope_head_dim=16"]))


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
    row = np.zeros(cache.shape[-1])                                        # r + dr, then zero padding
    row[:r + dr] = np.concatenate([ckv, c[r:]])
    new_cache[s, lengths[s]] = row
    lat = new_cache[s, :lengths[s] + 1]                                   # [l, latent_width]
    kv = (lat[:, :r] @ wb).reshape(-1, nh, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(lat[:, None, r:r + dr], (lat.shape[0], nh, dr))], -1)
    q = (xs @ wq).reshape(nh, dn + dr)
    sc = np.einsum("hd,lhd->hl", q, k) * (dn + dr) ** -0.5
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out.append(np.einsum("hl,lhd->hd", p, kv[..., dn:]).reshape(-1) @ wo)
  return np.array(out), new_cache


@pytest.mark.parametrize("args, width", [(ARGS, None), (WIDE, 256)], ids=["narrow", "padded"])
def test_mla_absorbed_decode_matches_expanded_oracle(args, width):
  """The padded case's cache holds noise in its padding columns: the zero query columns that meet them
  keep the result that of the unpadded width."""
  with nnx.use_eager_sharding(False):  # as KimiLinearForCausalLM builds its modules
    m = MultiHeadLatentAttention(args, rngs=nnx.Rngs(3))
  assert m.latent_width == (width or m.rank + m.dr)
  rng = np.random.default_rng(0)
  s, length = 3, 10
  x = rng.normal(0, 1, (s, args.hidden_size)).astype(np.float32)
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


@pytest.mark.parametrize("args", [ARGS, WIDE], ids=["narrow", "padded"])
def test_mla_prefill_continued_from_its_cache_equals_one_prefill(args):
  """A prompt prefilled in two chunks (the second reads the first's cached latents as its prefix, in
  the absorbed form) against the same prompt in one prefill: the padded latent keeps them equal."""
  with nnx.use_eager_sharding(False):
    m = MultiHeadLatentAttention(args, rngs=nnx.Rngs(4))
  rng = np.random.default_rng(1)
  t, a, length = 23, 9, 32
  x = jnp.asarray(rng.normal(0, 1, (1, t, args.hidden_size)), jnp.float32)
  seg = jnp.ones((1, t), jnp.int32)
  whole, _ = m(x, segment_ids=seg, mode="prefill", num_slots=1)
  first, cache = m(x[:, :a], segment_ids=seg[:, :a], mode="prefill", num_slots=1, return_cache=True,
                   cache_length=length)
  assert cache.latent.shape == (1, length, m.latent_width)
  np.testing.assert_array_equal(np.asarray(cache.latent)[0, :a, m.rank + m.dr:], 0.0)   # the padding
  rest, _ = m(x[:, a:], segment_ids=seg[:, a:], mode="prefill", num_slots=1, cache=cache,
              lengths=jnp.asarray([a], jnp.int32))
  np.testing.assert_allclose(np.asarray(first), np.asarray(whole)[:, :a], atol=1e-6, rtol=0)
  np.testing.assert_allclose(np.asarray(rest), np.asarray(whole)[:, a:], atol=2e-6, rtol=0)
