"""MLA's attention without `[T, T]` scores (model/nn/attention.py) against a NumPy float64 oracle.

Cases: packed documents, steep causal rows (documents of 1-3 tokens), padding tokens (segment 0)
inside and at the end of a row, a row of padding only (no valid key: zeros, no NaN), rows not a
multiple of the tile, float32 and bfloat16 inputs, the log-sum-exp a cached prefix is merged with,
and gradients. Tile-pair skipping is checked by poisoning (NaN) the keys and values of a document
whose tiles a later document never needs to visit. The splash kernel runs on CPU in Pallas
interpret mode. The MLA layer itself is compared across `mla_impl` with and without a cached prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ConfigError, ModelArgs, load_config
from model.nn import attention
from model.nn.mla import MultiHeadLatentAttention

SCALE = 0.3


def _oracle(q, k, v, seg, scale):
  """float64 causal softmax within documents: (o [B, T, H, Dv], lse [B, H, T] with -inf for no key)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  seg = np.asarray(seg)
  b, t, h, _ = q.shape
  o = np.zeros((b, t, h, v.shape[-1]))
  lse = np.full((b, h, t), -np.inf)
  for r in range(b):
    for i in range(t):
      if seg[r, i] == 0:
        continue
      keys = [j for j in range(i + 1) if seg[r, j] == seg[r, i]]
      s = np.einsum("hd,jhd->hj", q[r, i], k[r, keys]) * scale
      m = s.max(-1, keepdims=True)
      p = np.exp(s - m)
      o[r, i] = np.einsum("hj,jhd->hd", p / p.sum(-1, keepdims=True), v[r, keys])
      lse[r, :, i] = m[:, 0] + np.log(p.sum(-1))
  return o, lse


def _segments(t):
  """Two rows of `t` tokens: [long document | steep tiny documents | padding gap | document | padding
  tail] and [one token of padding | one document to the end]; plus a third row of padding only."""
  seg = np.zeros((3, t), np.int32)
  a = t // 3
  seg[0, :a] = 1
  tiny = np.repeat(np.arange(2, 8), [1, 2, 3, 1, 2, 3])          # documents of 1-3 tokens
  seg[0, a:a + tiny.size] = tiny
  seg[0, a + tiny.size + 5:t - 7] = 9
  seg[1, 1:] = 4
  return seg


def _inputs(t, h, dk, dv, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.normal(0, 1, (3, t, h, d)).astype(np.float32) for d in (dk, dk, dv))
  return [jnp.asarray(a, dtype) for a in (q, k, v)], jnp.asarray(_segments(t))


def _check_against_oracle(o, lse, q, k, v, seg, atol, scale=SCALE):
  want_o, want_lse = _oracle(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32),
                             seg, scale)
  assert o.dtype == jnp.float32 and not np.isnan(np.asarray(o)).any()
  np.testing.assert_allclose(np.asarray(o), want_o, atol=atol, rtol=0)
  valid = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(lse)[valid], want_lse[valid], atol=atol, rtol=0)
  np.testing.assert_array_equal(np.asarray(lse)[~valid], np.float32(attention.NEG))
  np.testing.assert_array_equal(np.asarray(o)[np.asarray(seg) == 0], 0.0)


@pytest.mark.parametrize("t, tile", [(300, 128), (256, 64), (40, 256)])   # padded row, whole tiles, one tile
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiled_matches_float64_oracle(t, tile, dtype):
  (q, k, v), seg = _inputs(t, 2, 24, 16, dtype)
  o, lse = jax.jit(lambda q, k, v, s: attention.tiled_attention(q, k, v, s, scale=SCALE, tile=tile))(q, k, v, seg)
  # The tiled path computes in float32 whatever the input dtype: against the oracle of the same
  # (bf16-rounded) inputs it is exact to float32 summation order.
  _check_against_oracle(o, lse, q, k, v, seg, atol=2e-6)


def test_dense_reference_matches_float64_oracle():
  (q, k, v), seg = _inputs(70, 2, 8, 8, jnp.float32)
  o, lse = attention.dense_attention(q, k, v, seg, scale=SCALE)
  _check_against_oracle(o, lse, q, k, v, seg, atol=2e-6)


def _weighted_loss(fn):
  """A loss reading o and the finite lse (the merge with a cached prefix reads both)."""
  def loss(q, k, v):
    o, lse = fn(q, k, v)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
    return jnp.sum(o * w) + jnp.sum(jnp.where(lse > attention.NEG / 2, jnp.sin(lse), 0.0))
  return loss


@pytest.mark.parametrize("t, tile", [(300, 128), (40, 256)])
def test_tiled_gradients_match_dense(t, tile):
  """The custom VJP (flash attention 2's backward over the same tile pairs) against autodiff of the
  dense reference, both float32; padding tokens and the all-padding row get zero, finite gradients."""
  (q, k, v), seg = _inputs(t, 2, 24, 16, jnp.float32, seed=1)
  tiled = jax.jit(jax.grad(_weighted_loss(
      lambda q, k, v: attention.tiled_attention(q, k, v, seg, scale=SCALE, tile=tile)), argnums=(0, 1, 2)))
  dense = jax.grad(_weighted_loss(lambda q, k, v: attention.dense_attention(q, k, v, seg, scale=SCALE)),
                   argnums=(0, 1, 2))
  for got, want in zip(tiled(q, k, v), dense(q, k, v)):
    assert np.isfinite(np.asarray(got)).all()
    scale = float(np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * scale, rtol=0)
  dq = np.asarray(tiled(q, k, v)[0])
  np.testing.assert_array_equal(dq[np.asarray(seg) == 0], 0.0)


def test_tiled_skips_tile_pairs_across_documents():
  """Document 1 fills tiles 0-1 of 64 tokens and holds NaN keys and values; document 2 (tiles 2-3) and
  the padding after it are exact, forward and backward: their tiles never visit tiles 0-1 (a visited
  pair would give 0 * NaN = NaN through the masked product)."""
  t, tile = 256, 64
  rng = np.random.default_rng(2)
  q, k, v = (rng.normal(0, 1, (1, t, 2, 8)).astype(np.float32) for _ in range(3))
  seg = np.zeros((1, t), np.int32)
  seg[0, :128], seg[0, 128:250] = 1, 2
  k[0, :128], v[0, :128] = np.nan, np.nan
  want, _ = _oracle(q[:, 128:], k[:, 128:], v[:, 128:], seg[:, 128:], SCALE)
  f = lambda q, k, v: attention.tiled_attention(q, k, v, jnp.asarray(seg), scale=SCALE, tile=tile)
  o, _ = jax.jit(f)(q, k, v)
  np.testing.assert_allclose(np.asarray(o)[:, 128:], want, atol=2e-6, rtol=0)
  dq, dk, dv = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0][:, 128:]), argnums=(0, 1, 2)))(q, k, v)
  for g in (dq, dk, dv):
    assert np.isfinite(np.asarray(g)[:, 128:]).all()


def test_tiled_memory_is_linear_in_the_row():
  """Compiled temporaries (XLA:CPU) of the tiled forward and backward at T and 4T: at most 4.5x (linear
  plus a constant), where the dense reference's grow 16x with its [T, T] scores."""
  def temp(fn, t):
    (q, k, v), seg = (jax.ShapeDtypeStruct((1, t, 4, d), jnp.float32) for d in (32, 32, 16)), \
        jax.ShapeDtypeStruct((1, t), jnp.int32)
    return jax.jit(fn).lower(q, k, v, seg).compile().memory_analysis().temp_size_in_bytes

  fwd = lambda q, k, v, s: attention.tiled_attention(q, k, v, s, scale=SCALE, tile=128)[0]
  grad = lambda q, k, v, s: jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v, s)), argnums=(0, 1, 2))(q, k, v)
  dense = lambda q, k, v, s: attention.dense_attention(q, k, v, s, scale=SCALE)[0]
  for fn in (fwd, grad):
    assert temp(fn, 4096) <= 4.5 * temp(fn, 1024)
  assert temp(dense, 4096) >= 12 * temp(dense, 1024)   # the check can see quadratic growth


def test_splash_interpret_matches_float64_oracle():
  """The Pallas TPU splash kernel (interpret mode on CPU) at MLA's head dims (qk 192, v 128): output and
  log-sum-exp, a row padded to 128 tokens, MLA's softmax scale 192 ** -0.5. The differentiable form
  too (no lse)."""
  (q, k, v), seg = _inputs(200, 2, 192, 128, jnp.float32, seed=3)
  scale = 192 ** -0.5
  o, lse = attention.splash_attention(q, k, v, seg, scale=scale, interpret=True)
  _check_against_oracle(o, lse, q, k, v, seg, atol=2e-6, scale=scale)
  o2, none = attention.splash_attention(q, k, v, seg, scale=scale, interpret=True, with_lse=False)
  assert none is None
  np.testing.assert_allclose(np.asarray(o2), np.asarray(o), atol=0, rtol=0)


def test_splash_kernel_is_not_reused_across_traces():
  """Two jits of the splash gradient, each lowered, compiled and called as `Compiled` (what kda-train does),
  and the second traced after the first. The kernel's mask metadata is made while tracing; a kernel kept
  from the first trace carried its values into the second (UnexpectedTracerError here; on a TPU, hidden
  extra inputs: "compiled for 392 inputs but called with 382" at kda-train's first step, jax 0.10.2)."""
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.normal(0, 1, (1, 128, 1, 128)), jnp.float32) for _ in range(3))
  seg = jnp.asarray(np.repeat([1, 2], 64)[None].astype(np.int32))
  for scale in (0.1, 0.2):   # two different functions: two traces
    def loss(q, scale=scale):
      return jnp.sum(attention.splash_attention(q, k, v, seg, scale=scale, interpret=True, with_lse=False)[0] ** 2)

    got = jax.jit(jax.grad(loss)).lower(q).compile()(q)
    want = jax.grad(lambda q: jnp.sum(attention.dense_attention(q, k, v, seg, scale=scale)[0] ** 2))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(np.abs(want).max()), rtol=0)


@pytest.mark.slow
def test_splash_interpret_gradients_match_dense():
  (q, k, v), seg = _inputs(200, 2, 192, 128, jnp.float32, seed=4)
  w = jnp.cos(jnp.arange(3 * 200 * 2 * 128, dtype=jnp.float32).reshape(3, 200, 2, 128))
  splash = jax.grad(lambda q, k, v: jnp.sum(attention.splash_attention(
      q, k, v, seg, scale=SCALE, interpret=True, with_lse=False)[0] * w), argnums=(0, 1, 2))(q, k, v)
  dense = jax.grad(lambda q, k, v: jnp.sum(attention.dense_attention(q, k, v, seg, scale=SCALE)[0] * w),
                   argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(splash, dense):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(np.abs(want).max()), rtol=0)


def test_resolve_impl_by_platform():
  assert attention.resolve_impl("auto", "tpu") == "splash"
  assert attention.resolve_impl("auto", "cpu") == "tiled"
  assert attention.resolve_impl("auto", "gpu") == "tiled"
  assert attention.resolve_impl("dense", "tpu") == "dense"
  with pytest.raises(ValueError, match="mla_impl='splash' runs only on TPU"):
    attention.resolve_impl("splash", "cpu")
  with pytest.raises(ValueError, match="mla_impl must be one of"):
    attention.resolve_impl("flash", "tpu")
  with pytest.raises(ConfigError, match="mla_impl must be one of"):
    ModelArgs.from_config(load_config(["tiny", "mla_impl=flash"]))


def _mla(impl, dtype):
  args = ModelArgs.from_config(load_config(["tiny", f"mla_impl={impl}", f"dtype={dtype}"]))
  with nnx.use_eager_sharding(False):
    return MultiHeadLatentAttention(args, rngs=nnx.Rngs(7))


@pytest.mark.parametrize("dtype, atol", [("float32", 2e-6), ("bfloat16", 1e-2)])
def test_mla_layer_tiled_equals_dense(dtype, atol):
  """The MLA layer with mla_impl=tiled against mla_impl=dense (the [T, T] form it replaced): a prefill
  without a cache (a row longer than one tile) and a window after a cached prefix. In bfloat16 both
  compute attention in float32 from the same rounded q, k, v; what differs is the float32 summation
  order, then o_proj's bfloat16 output rounding (one bf16 ulp at |y| ~ 1 is 8e-3)."""
  from model.nn import attention as attn_mod
  rng = np.random.default_rng(5)
  tiled, dense = _mla("tiled", dtype), _mla("dense", dtype)
  nnx.update(dense, nnx.state(tiled))  # the same parameters
  d = tiled.q_proj.kernel.shape[0]
  t = attn_mod.TILE + 44
  x = jnp.asarray(rng.normal(0, 1, (2, t, d)), tiled.dtype)
  seg = np.zeros((2, t), np.int32)
  seg[0, :100], seg[0, 100:290] = 1, 2
  seg[1, 3:] = 1
  y_t, lat_t = tiled.attend(x, segment_ids=jnp.asarray(seg))
  y_d, lat_d = dense.attend(x, segment_ids=jnp.asarray(seg))
  np.testing.assert_array_equal(np.asarray(lat_t), np.asarray(lat_d))
  np.testing.assert_allclose(np.asarray(y_t, np.float32), np.asarray(y_d, np.float32), atol=atol, rtol=0)
  assert not np.isnan(np.asarray(y_t, np.float32)).any()
  # A window after a cached prefix: slots of 0, 5 and 17 cached tokens.
  prefix = jnp.asarray(rng.normal(0, 1, (2, 2, 24, tiled.latent_width)), tiled.dtype)
  plen = jnp.asarray([[5, 17], [0, 3]], jnp.int32)
  y_t, _ = tiled.attend(x, segment_ids=jnp.asarray(seg), prefix=prefix, prefix_lengths=plen)
  y_d, _ = dense.attend(x, segment_ids=jnp.asarray(seg), prefix=prefix, prefix_lengths=plen)
  np.testing.assert_allclose(np.asarray(y_t, np.float32), np.asarray(y_d, np.float32), atol=atol, rtol=0)
  np.testing.assert_array_equal(np.asarray(y_t, np.float32)[seg == 0], 0.0)


def test_mla_cache_rows_are_a_multiple_of_8():
  """model/nn/cache.py `mla_rows`: at a row count that is not a multiple of 8, XLA:TPU copied every MLA
  layer's whole cache at each decode step (tests/aot checks the compiled step); a new cache, made
  empty or by a prefill, rounds its rows up, and the decode over the extra rows is unchanged."""
  from model.config import load_config
  from model.nn import cache as cache_lib
  from model.nn.kimi_linear import KimiLinearForCausalLM
  assert [cache_lib.mla_rows(n) for n in (1, 8, 9, 1056, 1057)] == [8, 8, 16, 1056, 1064]
  model = KimiLinearForCausalLM(load_config(["tiny", "attention=kda_chunked"]))
  assert model.init_cache(2, num_slots=1, cache_length=13).cache_length == 16
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (1, 11)), jnp.int32)
  logits13, cache13 = model.prefill(ids, cache_length=13, logits_at="last")
  logits16, cache16 = model.prefill(ids, cache_length=16, logits_at="last")
  assert cache13.cache_length == 16
  np.testing.assert_array_equal(np.asarray(logits13), np.asarray(logits16))
  nxt = jnp.argmax(logits13, axis=-1).astype(jnp.int32)
  np.testing.assert_array_equal(np.asarray(model.decode(nxt, cache13)[0]), np.asarray(model.decode(nxt, cache16)[0]))
