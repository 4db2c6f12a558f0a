"""Multi-head latent attention (MLA) of Kimi-Linear, without positional encoding.

Source: DeepSeek-V2 MLA as used by transformers `KimiLinearAttention` / Moonshot `modeling_kimi.py`
(parameter names: docs/checkpoints.md section 'Parameter names'). With latent c = kv_a_proj_with_mqa(x) = [c_kv (r) | k_r (dr)]:
`c_kv <- kv_a_layernorm(c_kv)` (eps 1e-6); `[k_nope | v] = kv_b_proj(c_kv)` per head;
key = `[k_nope | k_r]` (k_r shared by every head, never rotated: NoPE); query = `q_proj(x)` per head
`[q_nope | q_r]` (or `q_b_proj(q_a_layernorm(q_a_proj x))` with q_lora_rank); softmax scale
`(dn + dr) ** -0.5`; causal attention within each document; `o_proj`.
The row's own causal attention never forms `[T, T]` scores: `model/nn/attention.py`, chosen by
`mla_impl` (auto: the Pallas splash kernel on TPU, the tiled XLA online softmax elsewhere).

The cache keeps, per token, the normalised `c_kv` followed by `k_r` (r + dr values); keys and
values are re-expanded from it. Parameters (HF name -> here, `.weight` -> `.kernel` transposed):
`q_proj.kernel [d, nH*(dn+dr)]` (or `q_a_proj [d, rq]`, `q_a_layernorm.scale [rq]`,
`q_b_proj [rq, nH*(dn+dr)]`), `kv_a_proj_with_mqa.kernel [d, r+dr]`, `kv_a_layernorm.scale [r]`,
`kv_b_proj.kernel [r, nH*(dn+dv)]`, `o_proj.kernel [nH*dv, d]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model import partitioning
from model.nn import attention
from model.nn import cache as cache_lib
from model.nn.layers import RMSNorm, as_dtype, linear

_NEG = attention.NEG  # finite "minus infinity": a fully masked row gives zeros, not NaN
# Cached tokens per step of the prefix loop (`_attend_prefix_then_window`): bounds the prefix scores to
# [B, H, T, N, PREFIX_BLOCK] and the loop's wasted work (the last block's invalid tail) to this many.
PREFIX_BLOCK = 128
# A cached latent wider than this is padded with zero columns to a multiple of it (`latent_width`).
LATENT_LANES = 128
# Tokens per region of the prefix attention (after the first N; `_attend_prefix_then_window`): each
# region loops over as many prefix blocks as its own tokens need.
PREFIX_REGION = 256


class MultiHeadLatentAttention(nnx.Module):
  """MLA mixer (see the module docstring).

  Args:
    args: `model.config.ModelArgs`. rngs: initialisation keys.
  """

  def __init__(self, args, *, rngs: nnx.Rngs):
    d, nh = args.hidden_size, args.num_attention_heads
    self.num_heads, self.dn, self.dr, self.dv = nh, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    self.rank = args.kv_lora_rank
    self.impl = args.mla_impl  # resolved per call (model/nn/attention.py resolve_impl: the platform traced for)
    self.scale = float(self.dn + self.dr) ** -0.5
    self.dtype = as_dtype(args.dtype)
    wdt = as_dtype(args.weight_dtype)
    dq = nh * (self.dn + self.dr)
    if args.q_lora_rank is None:
      self.q_proj = linear(d, dq, ("embed", "heads"), args, rngs)
    else:
      self.q_a_proj = linear(d, args.q_lora_rank, ("embed", None), args, rngs)
      self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps=args.mla_kv_norm_eps, param_dtype=wdt,
                                   dtype=self.dtype, axes=(None,))
      self.q_b_proj = linear(args.q_lora_rank, dq, (None, "heads"), args, rngs)
    self.q_lora = args.q_lora_rank is not None
    self.kv_a_proj_with_mqa = linear(d, self.rank + self.dr, ("embed", "kv"), args, rngs)
    self.kv_a_layernorm = RMSNorm(self.rank, eps=args.mla_kv_norm_eps, param_dtype=wdt, dtype=self.dtype,
                                  axes=("kv",))
    self.kv_b_proj = linear(self.rank, nh * (self.dn + self.dv), ("kv", "heads"), args, rngs)
    self.o_proj = linear(nh * self.dv, d, ("heads", "embed"), args, rngs)

  @property
  def latent_width(self) -> int:
    """Columns of a cached latent: `r + dr`, padded with zero columns to a multiple of `LATENT_LANES`
    when wider than it (Kimi's 512 + 64 = 576 -> 640). TPU keeps a `[S, L, C]` array with C minor
    only when C fills whole 128-lane tiles; at 576 it lays L minor, and every decode step then copied
    the whole cache into the other layout and back (docs/performance.md, "MLA decode: the latent
    cache's layout"). Narrower latents (test models) are not padded."""
    w = self.rank + self.dr
    return w if w <= LATENT_LANES else -(-w // LATENT_LANES) * LATENT_LANES

  def _pad_latent(self, x):
    """`[..., r + dr]` -> `[..., latent_width]` with zero columns (queries against the cache too: a
    zero query column meets the cache's padding, so the products are those of the unpadded width)."""
    pad = self.latent_width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])

  def query(self, x):
    """`[..., d]` -> `[..., nH, dn + dr]`."""
    q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
    return q.reshape(q.shape[:-1] + (self.num_heads, self.dn + self.dr))

  def latent(self, x):
    """`[..., d]` -> cached latent `[..., latent_width]` = [kv_a_layernorm(c_kv) | k_r | zero padding]."""
    c = self.kv_a_proj_with_mqa(x)
    return self._pad_latent(jnp.concatenate([self.kv_a_layernorm(c[..., :self.rank]), c[..., self.rank:]], axis=-1))

  def expand(self, lat):
    """Latent `[..., latent_width]` -> (keys `[..., nH, dn + dr]`, values `[..., nH, dv]`)."""
    kv = self.kv_b_proj(lat[..., :self.rank])
    kv = kv.reshape(kv.shape[:-1] + (self.num_heads, self.dn + self.dv))
    k_r = jnp.broadcast_to(lat[..., None, self.rank:self.rank + self.dr], kv.shape[:-1] + (self.dr,))
    return jnp.concatenate([kv[..., :self.dn], k_r], axis=-1), kv[..., self.dn:]

  def _out(self, o):
    return self.o_proj(o.astype(self.dtype).reshape(o.shape[:-2] + (-1,)))

  # --- the mixer interface (model/nn/kimi_linear.py `Mixer`) --------------------------------------
  def __call__(self, x, *, segment_ids, mode, num_slots, cache=None, lengths=None, return_cache=False,
               cache_length=None):
    """Sequence forward over packed rows; with `cache`, each document continues its slot's prefix.

    Args:
      x: `[B, T, d]`. segment_ids: int32 `[B, T]`. mode: unused (one path for every mode).
      num_slots: N. cache: incoming `MLALayerCache` (decode layout, S = B*N) or None.
      lengths: int32 `[S]`, tokens in the incoming cache (with `cache`). return_cache: also return
      the `MLALayerCache` with these tokens' latents written after each slot's prefix.
      cache_length: L of a new cache (when `cache` is None).

    Returns:
      `(y [B, T, d], MLALayerCache | None)`.
    """
    b = x.shape[0]
    prefix = None if cache is None else cache_lib.rows_to_slots(cache.latent, b, num_slots)
    plen = None if cache is None else cache_lib.rows_to_slots(lengths, b, num_slots)
    y, lat = self.attend(x, segment_ids=segment_ids, prefix=prefix, prefix_lengths=plen)
    if not return_cache:
      return y, None
    return y, cache_lib.MLALayerCache(_write_latents(lat, segment_ids, prefix, plen, num_slots, cache_length))

  def decode(self, x, cache, lengths):
    """One token per sequence: `(y [S, d], new MLALayerCache)` (see `decode_latent`)."""
    y, latent = self.decode_latent(x, cache.latent, lengths)
    return y, cache_lib.MLALayerCache(latent)

  def empty_cache(self, num_sequences: int, cache_length: int):
    """A zero `MLALayerCache` of `cache_length` token slots for `num_sequences` fresh sequences."""
    return cache_lib.empty_mla_cache(num_sequences, cache_length, self.latent_width, self.dtype)

  # --- the attention itself --------------------------------------------------------------------------
  def attend(self, x, *, segment_ids, prefix=None, prefix_lengths=None):
    """Causal attention within documents of packed rows, optionally after a per-slot prefix.

    Args:
      x: `[B, T, d]`. segment_ids: int32 `[B, T]` (0 = padding: attends to nothing, output 0).
      prefix: latent `[B, N, L, latent_width]` of each slot's earlier tokens, or None.
      prefix_lengths: int32 `[B, N]`, valid prefix tokens per slot (entries at >= length ignored).

    Returns:
      `(y [B, T, d], latent [B, T, latent_width])`; the latent is what a cache stores for these tokens.
    """
    q = self.query(x)
    lat = self.latent(x)
    k, v = self.expand(lat)
    impl = attention.resolve_impl(self.impl)
    seg = segment_ids
    o, lse = self._self_attention(q, k, v, seg, impl, with_lse=prefix is not None)
    if prefix is None:
      return self._out(o), lat
    # The window's own softmax parts (m, l, acc) = (lse, 1, o): acc / l = o and l * exp(m) = exp(lse);
    # padding tokens (no key) give (NEG, 0, 0).
    window = (lse, jnp.broadcast_to((seg > 0)[:, None, :], lse.shape).astype(jnp.float32),
              jnp.transpose(o, (0, 2, 1, 3)))
    o = self._attend_prefix_then_window(q.astype(jnp.float32), window, prefix, prefix_lengths, seg)
    return self._out(o), lat

  def _self_attention(self, q, k, v, seg, impl, *, with_lse):
    """Causal attention of the row's own tokens within their documents (`model/nn/attention.py`):
    `(o [B, T, H, dv] float32, lse [B, H, T] float32 or None)`.

    "splash" runs the Pallas kernel on each device's batch rows and heads (`partitioning.per_shard`:
    GSPMD cannot split a Pallas call), its operands in the compute dtype (bfloat16 on the MXU); its
    residual-saving form (`with_lse`, for merging a cached prefix) has no VJP, so training and a
    prefill without a cache take the differentiable form. "tiled" and "dense" compute in float32.
    """
    if impl != "splash":
      return attention.segment_attention(q, k, v, seg, scale=self.scale, impl=impl)
    s = partitioning

    def kernel(q, k, v, seg):
      o, lse = attention.splash_attention(q, k, v, seg, scale=self.scale, with_lse=with_lse)
      return (o,) if lse is None else (o, jnp.transpose(lse, (0, 2, 1)))

    outs = s.per_shard(kernel, tuple(a.astype(self.dtype) for a in (q, k, v)) + (seg,),
                       in_axes=(s.HEADS_BTHK,) * 3 + (s.BATCH_TOKENS,),
                       out_axes=(s.HEADS_BTHK, s.HEADS_BTH)[:1 + bool(with_lse)])
    return outs[0], (jnp.transpose(outs[1], (0, 2, 1)) if with_lse else None)

  def _absorbed_weights(self):
    """`kv_b_proj` split per head: `(W_uk [r, nH, dn], W_uv [r, nH, dv])` in float32, rounded through
    the compute dtype as `expand` sees it (DeepSeek-V2 section 2.1.2's absorption)."""
    w = self.kv_b_proj.kernel[...].astype(self.dtype).astype(jnp.float32)
    w = w.reshape(self.rank, self.num_heads, self.dn + self.dv)
    return w[..., :self.dn], w[..., self.dn:]

  def _attend_prefix_then_window(self, q, window, prefix, prefix_lengths, seg):
    """Softmax over [own slot's prefix | the window's own keys], streamed over the prefix.

    The window's own keys are expanded (`expand`); the prefix is attended in the absorbed form
    (as `decode_latent`): each token's query is mapped into latent space once (`W_uk`), scored
    against the latents of ITS OWN slot only (block by block: one block per region when every token
    of the region with a prefix reads the same slot, as a prompt chunk's do; else gathered per
    token), and the weighted latents go through `W_uv` once at the end. The work is
    O(T * own prefix * (r + dr)) per head, not O(T * N * L) as attending every slot's prefix and
    masking would be.

    One online softmax per token (running max `m`, denominator `l`, weighted latents `acc`; the same
    rescaling as flash attention) visits the prefix in blocks of `PREFIX_BLOCK` cached tokens, only as
    many blocks as the longest own prefix among the tokens of a region (`lax.fori_loop` with a
    data-dependent trip count). The row is cut into regions, its first N tokens, then runs of
    `PREFIX_REGION` tokens: the engine packs decode tokens (one per slot, long prefixes) first and
    prompt chunks after, so a new prompt's tokens (no prefix) do not loop over the longest
    decoding request's prefix, nor over a continued chunk's. The window part and the prefix part
    are merged at the end.

    Args:
      q: float32 `[B, T, nH, dn + dr]`. window: the window's own softmax parts `(m, l [B, H, T], acc [B, H, T, dv])`.
      prefix: latent `[B, N, L, latent_width]`. prefix_lengths: int32 `[B, N]`. seg: int32 `[B, T]` (label
      n reads slot n-1's prefix; 0 = padding).

    Returns:
      float32 `[B, T, nH, dv]`, zeros for padding tokens.
    """
    b, n, length, _ = prefix.shape
    t = q.shape[1]
    block = min(PREFIX_BLOCK, length)
    if length % block:  # the last block must not run past L (dynamic_slice would shift it back)
      prefix = jnp.pad(prefix, ((0, 0), (0, 0), (0, block - length % block), (0, 0)))
    slot = jnp.clip(seg - 1, 0, n - 1)                                                    # [B, T]
    own_length = jnp.where(seg > 0, jnp.take_along_axis(prefix_lengths, slot, axis=1), 0)  # [B, T]
    w_uk, w_uv = self._absorbed_weights()
    q_abs = self._pad_latent(jnp.concatenate([jnp.einsum("bthd,rhd->bthr", q[..., :self.dn], w_uk), q[..., self.dn:]],
                                             axis=-1))
    rows = jnp.arange(b)[:, None]

    def region(lo, hi):
      """Online softmax of tokens [lo, hi) over their own prefixes: (m, l [B, H, t], acc [B, H, t, r])."""
      qa, sl, own = q_abs[:, lo:hi], slot[:, lo:hi], own_length[:, lo:hi]
      tr = hi - lo

      # The slot of the region's deepest prefix: when every token with a prefix reads that one slot
      # (a prompt chunk: the common case past the decode tokens), each block is one [B, blk, C] slice
      # shared by the region's tokens instead of a [B, t, blk, C] gather of per-token copies
      # (the same products; on CPU the copies cost more than the attention itself).
      lead = jnp.take_along_axis(sl, jnp.argmax(own, axis=1)[:, None], axis=1)          # [B, 1]
      one_slot = jnp.all((sl == lead) | (own == 0))

      def visit(j, carry, shared):
        m, l, acc = carry
        lat = jax.lax.dynamic_slice_in_dim(prefix, j * block, block, axis=2)              # [B, N, blk, C]
        if shared:
          c = lat[rows[:, 0], lead[:, 0]]                                                 # [B, blk, C]
          score_spec, out_spec = "bthc,blc->bhtl", "bhtl,blr->bhtr"
        else:
          c = lat[rows, sl]                                                               # [B, t, blk, C]
          score_spec, out_spec = "bthc,btlc->bhtl", "bhtl,btlr->bhtr"
        c = c.astype(self.dtype).astype(jnp.float32)
        sp = jnp.einsum(score_spec, qa, c) * self.scale
        valid = (j * block + jnp.arange(block))[None, None, :] < own[:, :, None]          # [B, t, blk]
        sp = jnp.where(valid[:, None], sp, _NEG)
        m_new = jnp.maximum(m, jnp.max(sp, axis=-1))
        rescale = jnp.exp(m - m_new)
        pp = jnp.where(valid[:, None], jnp.exp(sp - m_new[..., None]), 0.0)               # [B, H, t, blk]
        o = jnp.einsum(out_spec, pp, c[..., :self.rank])
        return m_new, l * rescale + jnp.sum(pp, axis=-1), acc * rescale[..., None] + o

      h = self.num_heads
      init = (jnp.full((b, h, tr), _NEG, jnp.float32), jnp.zeros((b, h, tr), jnp.float32),
              jnp.zeros((b, h, tr, self.rank), jnp.float32))
      num_blocks = (jnp.max(own) + block - 1) // block
      loop = lambda shared: lambda: jax.lax.fori_loop(0, num_blocks, functools.partial(visit, shared=shared),
                                                      init)
      return jax.lax.cond(one_slot, loop(True), loop(False))

    bounds = [0] + list(range(min(n, t), t, PREFIX_REGION)) + [t]
    parts = [region(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    m_p, l_p, acc_p = (jnp.concatenate(x, axis=2) for x in zip(*parts))
    # The merge of the window's and the prefix's softmax parts.
    m_w, l_w, acc_w = window
    m = jnp.maximum(m_w, m_p)
    a_w, a_p = jnp.exp(m_w - m), jnp.exp(m_p - m)
    l = l_w * a_w + l_p * a_p
    acc = acc_w * a_w[..., None] + jnp.einsum("bhtr,rhd->bhtd", acc_p, w_uv) * a_p[..., None]
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.transpose(o, (0, 2, 1, 3))

  def decode_latent(self, x, latent_cache, lengths):
    """One token per sequence against the latent cache.

    Computed in the absorbed form (DeepSeek-V2 section 2.1.2): with `kv_b_proj` split per head into
    `W_uk [r, nH, dn]` and `W_uv [r, nH, dv]`, `q_nope . (c W_uk) = (W_uk q_nope) . c` and
    `sum_l p_l (c_l W_uv) = (sum_l p_l c_l) W_uv`, so scores and outputs are taken against the
    cached latents directly instead of re-expanding keys and values for every cached token: the
    cost per step is O(L * nH * (r + dr)) instead of O(L * r * nH * (dn + dv)). Same math as
    `attend` up to float32 summation order (float32 throughout).

    Args:
      x: `[S, d]`. latent_cache: `[S, L, latent_width]`. lengths: int32 `[S]`, tokens already cached
        (the new token is written at index `lengths[s]`; callers keep `lengths < L`).

    Returns:
      `(y [S, d], new latent cache)`.
    """
    s = x.shape[0]
    q = self.query(x).astype(jnp.float32)                                  # [S, nH, dn + dr]
    lat = self.latent(x).astype(latent_cache.dtype)                        # [S, latent_width]
    # The new row is written first and the attention reads the written cache (rows <= lengths).
    # Attending over the incoming cache plus the new row apart, and writing last, was slower on the
    # lent v5e at the real-width shard (decode B=64 28.90 against 26.18 ms a step, B=8 15.53 against
    # 14.38: docs/performance.md "Decode: the MLA cache order"): XLA then read each cache from HBM
    # twice (scores, weighted sum) instead of streaming it through VMEM once.
    cache = latent_cache.at[jnp.arange(s), lengths].set(lat, mode="drop")
    c = cache.astype(self.dtype).astype(jnp.float32)                       # as expand() sees it
    w_uk, w_uv = self._absorbed_weights()
    q_lat = jnp.einsum("shd,rhd->shr", q[..., :self.dn], w_uk)             # [S, nH, r]
    # One product against the whole cached row [latent, shared key part] (the query's rope part
    # beside its absorbed part), and the weighted sum over the whole row, its latent part kept:
    # slicing the cache into the two parts first copies every slot's L rows each step.
    q_row = self._pad_latent(jnp.concatenate([q_lat, q[..., self.dn:]], axis=-1))   # [S, nH, latent_width]
    scores = jnp.einsum("shc,slc->shl", q_row, c) * self.scale                     # [S, nH, L]
    valid = (jnp.arange(cache.shape[1])[None, :] <= lengths[:, None])[:, None, :]
    scores = jnp.where(valid, scores, _NEG)
    p = jnp.where(valid, jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)), 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)   # the new row is valid: no empty row (lengths < L)
    o = jnp.einsum("shr,rhd->shd", jnp.einsum("shl,slc->shc", p, c)[..., :self.rank], w_uv)
    return self._out(o), cache


def _positions_in_run(segment_ids):
  """Index of each token inside its document's run in the row (0 for a run's first token)."""
  t = segment_ids.shape[1]
  pos = jnp.arange(t)
  first = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)
  return pos - start


def _write_latents(lat, segment_ids, prefix, prefix_lengths, num_slots, length):
  """Scatters each document's token latents after its slot's prefix: `[B*N, L, C]`."""
  b, t, c = lat.shape
  dtype = lat.dtype if prefix is None else prefix.dtype
  out = jnp.zeros((b, num_slots, cache_lib.mla_rows(length), c), dtype) if prefix is None else prefix
  slot = segment_ids - 1
  base = 0 if prefix_lengths is None else jnp.take_along_axis(prefix_lengths, jnp.clip(slot, 0, num_slots - 1), 1)
  index = base + _positions_in_run(segment_ids)
  slot = jnp.where(segment_ids > 0, slot, num_slots)  # padding: out of range, dropped
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  out = out.at[rows, slot, index].set(lat.astype(dtype), mode="drop")
  return cache_lib.slots_to_rows(out)
