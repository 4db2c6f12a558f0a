"""Causal softmax attention within the documents of packed rows, without forming `[T, T]` scores.

Two implementations of one contract (`segment_attention`), chosen by `resolve_impl`:
  - "tiled": XLA, flash attention's online softmax (running max and sum) over key tiles, tile pair by
    tile pair. Query tile i visits only key tiles from the one holding the start of its earliest
    document up to itself, so the work follows the documents' own lengths, not the row length
    squared, and the memory is `O(B * H * T * D)` plus one `[B, H, tile, tile]` block of scores. Its
    gradient is a `jax.custom_vjp` (flash attention 2's backward: scores recomputed tile pair by tile
    pair from the saved log-sum-exp), so training keeps linear memory too. Runs on every platform.
  - "splash": jax's Pallas TPU splash attention kernel (`jax.experimental.pallas.ops.tpu.
    splash_attention`) with a causal mask and segment ids; its backward is the kernel's own. The
    kernel skips the tile pairs above the diagonal, not the pairs of different documents below it
    (segment ids only mask inside a visited block). TPU only.
  - "dense" (the reference the others are tested against) forms `[B, H, T, T]` float32 scores.

Contract (all implementations): `q [B, T, H, Dk]`, `k [B, T, H, Dk]`, `v [B, T, H, Dv]`,
`segment_ids` int32 `[B, T]` (0 = padding), `scale` the softmax scale. Token t attends to tokens
s <= t of its own document (`segment_ids[b, s] == segment_ids[b, t] > 0`). Each document must be ONE
contiguous run of its label in the row (what packing and the engine produce); "tiled" skips the tile
pairs before the run's start. Returns `(o [B, T, H, Dv] float32, lse [B, H, T] float32)`: the
normalised output (zeros for padding tokens) and the log-sum-exp of each token's scaled scores
(`NEG` for padding tokens), with which a caller merges a second softmax part (the cached prefix).

Precision: "tiled" and "dense" compute in float32 whatever the input dtype. "splash" feeds the
kernel the inputs' dtype (bfloat16 operands for the MXU in a bfloat16 model; it accumulates in
float32), so in bfloat16 it differs from the float32 paths by the rounding of q, k and v.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity": a fully masked row gives zeros, not NaN
# Tokens per tile of the tiled path (queries and keys alike): scores of one tile pair are
# [B, H, TILE, TILE] float32 (B=1, H=8: 2 MiB).
TILE = 256
# Rows of at most this many tokens take the tiled path as one tile (no padding to TILE).
IMPLS = ("auto", "splash", "tiled", "dense")
# Splash block sizes tried in order: the largest that divides the (padded) row.
SPLASH_BLOCKS = (512, 256, 128)


def target_platform() -> str:
  """The platform traced for: the abstract mesh's device under `jax.set_mesh` /
  `jax.sharding.use_abstract_mesh` (an ahead-of-time compile for a TPU from a CPU host), else
  `jax.default_backend()` (the same rule as `kda_plugin.ops.inference.target_platform`)."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  device = getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_impl(impl: str, platform: str | None = None) -> str:
  """The implementation `impl` names on `platform` (default: the platform traced for,
  `target_platform`).

  "auto" is "splash" on TPU and "tiled" everywhere else. "splash" on another platform raises: the
  Mosaic kernel compiles only for TPU (tests run it on CPU through `interpret=True` explicitly).

  Raises:
    ValueError: `impl` not one of `IMPLS`, or "splash" asked for off TPU.
  """
  if impl not in IMPLS:
    raise ValueError(f"mla_impl must be one of {IMPLS}, got {impl!r}")
  platform = platform or target_platform()
  if impl == "auto":
    return "splash" if platform == "tpu" else "tiled"
  if impl == "splash" and platform != "tpu":
    raise ValueError(f"mla_impl='splash' runs only on TPU (the Pallas Mosaic kernel); this backend is "
                     f"{platform!r}: use mla_impl='tiled' or 'auto'")
  return impl


def segment_attention(q, k, v, segment_ids, *, scale: float, impl: str, tile: int = TILE,
                      interpret: bool = False):
  """Causal attention within documents; see the module docstring for the contract.

  Args:
    impl: "splash", "tiled" or "dense" (already resolved: `resolve_impl`).
    tile: tokens per tile of "tiled". interpret: run the splash kernel in Pallas interpret mode (tests
      on CPU).

  Returns:
    `(o [B, T, H, Dv] float32, lse [B, H, T] float32)`.
  """
  if impl == "tiled":
    return tiled_attention(q, k, v, segment_ids, scale=scale, tile=tile)
  if impl == "splash":
    return splash_attention(q, k, v, segment_ids, scale=scale, interpret=interpret)
  if impl == "dense":
    return dense_attention(q, k, v, segment_ids, scale=scale)
  raise ValueError(f"impl must be 'splash', 'tiled' or 'dense' (resolved), got {impl!r}")


def _mask(seg_q, seg_k, pos_q, pos_k):
  """[B, tq, tk] bool: same document, causal, query not padding."""
  return ((seg_q[:, :, None] == seg_k[:, None, :]) & (pos_q[:, None] >= pos_k[None, :])[None]
          & (seg_q > 0)[:, :, None])


def dense_attention(q, k, v, segment_ids, *, scale: float):
  """The `[B, H, T, T]` float32 reference (the MLA path before tiling)."""
  t = q.shape[1]
  pos = jnp.arange(t)
  mask = _mask(segment_ids, segment_ids, pos, pos)[:, None]                               # [B, 1, T, T]
  s = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale,
                NEG)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32))
  o = o / jnp.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]
  return o, jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), NEG)


# --- tiled (XLA) --------------------------------------------------------------------------------------
def _first_key_tiles(segment_ids, tile):
  """int32 `[T / tile]`: for each query tile, the key tile holding the start of its earliest document
  (over the batch). Non-decreasing (a document's start never exceeds its tokens' positions, and
  padding tokens start at themselves), so the query tiles that read key tile j are a contiguous run
  `[j, last[j]]`."""
  b, t = segment_ids.shape
  pos = jnp.arange(t)
  first = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  run_start = jax.lax.cummax(jnp.where(first, pos[None], 0), axis=1)
  start = jnp.where(segment_ids > 0, run_start, pos[None])
  return (jnp.min(start.reshape(b, t // tile, tile), axis=(0, 2)) // tile).astype(jnp.int32)


def _pad_rows(x, t_pad, value=0):
  t = x.shape[1]
  if t_pad == t:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, t_pad - t)
  return jnp.pad(x, widths, constant_values=value)


def _tile_size(t, tile):
  """(tile, padded length): rows of at most `tile` tokens are one tile of their own length."""
  if t <= tile:
    return t, t
  return tile, -(-t // tile) * tile


def tiled_attention(q, k, v, segment_ids, *, scale: float, tile: int = TILE):
  """The "tiled" implementation (module docstring). Differentiable in q, k, v (`jax.custom_vjp`)."""
  t = q.shape[1]
  tq, t_pad = _tile_size(t, tile)
  qf, kf, vf = (_pad_rows(x.astype(jnp.float32), t_pad) for x in (q, k, v))
  seg = _pad_rows(segment_ids.astype(jnp.int32), t_pad)
  o, lse = _tiled(qf, kf, vf, seg, float(scale), tq)
  return o[:, :t], lse[:, :, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tiled(q, k, v, seg, scale, tile):
  return _tiled_fwd(q, k, v, seg, scale, tile)[0]


def _tiled_fwd(q, k, v, seg, scale, tile):
  b, t, h, _ = q.shape
  dv = v.shape[-1]
  n = t // tile
  first = _first_key_tiles(seg, tile)
  offs = jnp.arange(tile)

  def query_tile(i, out):
    o_all, lse_all = out
    qi = jax.lax.dynamic_slice_in_dim(q, i * tile, tile, axis=1)
    si = jax.lax.dynamic_slice_in_dim(seg, i * tile, tile, axis=1)

    def key_tile(j, carry):
      m, l, acc = carry
      kj = jax.lax.dynamic_slice_in_dim(k, j * tile, tile, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(v, j * tile, tile, axis=1)
      sj = jax.lax.dynamic_slice_in_dim(seg, j * tile, tile, axis=1)
      mask = _mask(si, sj, i * tile + offs, j * tile + offs)[:, None]                     # [B, 1, tq, tk]
      s = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", qi, kj) * scale, NEG)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      rescale = jnp.exp(m - m_new)
      return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + jnp.einsum("bhts,bshd->bhtd",
                                                                                              p, vj)

    init = (jnp.full((b, h, tile), NEG, jnp.float32), jnp.zeros((b, h, tile), jnp.float32),
            jnp.zeros((b, h, tile, dv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first[i], i + 1, key_tile, init)
    valid = l > 0
    safe_l = jnp.where(valid, l, 1.0)
    oi = jnp.transpose(acc / safe_l[..., None], (0, 2, 1, 3))                               # [B, tq, H, Dv]
    lse_i = jnp.where(valid, m + jnp.log(safe_l), NEG)
    return (jax.lax.dynamic_update_slice_in_dim(o_all, oi, i * tile, axis=1),
            jax.lax.dynamic_update_slice_in_dim(lse_all, lse_i, i * tile, axis=2))

  out = (jnp.zeros((b, t, h, dv), jnp.float32), jnp.full((b, h, t), NEG, jnp.float32))
  o, lse = jax.lax.fori_loop(0, n, query_tile, out)
  return (o, lse), (q, k, v, seg, o, lse)


def _tiled_bwd(scale, tile, res, cotangents):
  """Flash attention 2's backward, tile pair by tile pair over the same pairs as the forward: for key
  tile j, the query tiles [j, last[j]] (`_first_key_tiles`). With p = exp(s - lse) (masked),
  dv = p^T do, dp = do v^T, ds = p * (dp - delta + dlse) with delta = rowsum(do * o), dq = ds k * scale,
  dk = ds^T q * scale."""
  q, k, v, seg, o, lse = res
  do, dlse = cotangents
  b, t, h, dk_dim = q.shape
  dv_dim = v.shape[-1]
  n = t // tile
  first = _first_key_tiles(seg, tile)
  last = jnp.sum(first[None, :] <= jnp.arange(n)[:, None], axis=1).astype(jnp.int32) - 1   # [n]
  delta = jnp.einsum("bthd,bthd->bht", do, o)                                              # [B, H, T]
  offs = jnp.arange(tile)

  def key_tile(j, carry):
    dq_all, dk_all, dv_all = carry
    kj = jax.lax.dynamic_slice_in_dim(k, j * tile, tile, axis=1)
    vj = jax.lax.dynamic_slice_in_dim(v, j * tile, tile, axis=1)
    sj = jax.lax.dynamic_slice_in_dim(seg, j * tile, tile, axis=1)

    def query_tile(i, inner):
      dq_all, dkj, dvj = inner
      qi = jax.lax.dynamic_slice_in_dim(q, i * tile, tile, axis=1)
      doi = jax.lax.dynamic_slice_in_dim(do, i * tile, tile, axis=1)
      si = jax.lax.dynamic_slice_in_dim(seg, i * tile, tile, axis=1)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * tile, tile, axis=2)
      corr_i = (jax.lax.dynamic_slice_in_dim(dlse, i * tile, tile, axis=2)
                - jax.lax.dynamic_slice_in_dim(delta, i * tile, tile, axis=2))
      mask = _mask(si, sj, i * tile + offs, j * tile + offs)[:, None]
      s = jnp.einsum("bthd,bshd->bhts", qi, kj) * scale
      p = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - jnp.where(mask, lse_i[..., None], 0.0)), 0.0)
      dvj = dvj + jnp.einsum("bhts,bthd->bshd", p, doi)
      dp = jnp.einsum("bthd,bshd->bhts", doi, vj)
      ds = p * (dp + corr_i[..., None]) * scale
      dkj = dkj + jnp.einsum("bhts,bthd->bshd", ds, qi)
      dqi = jax.lax.dynamic_slice_in_dim(dq_all, i * tile, tile, axis=1) + jnp.einsum("bhts,bshd->bthd", ds, kj)
      return jax.lax.dynamic_update_slice_in_dim(dq_all, dqi, i * tile, axis=1), dkj, dvj

    init = (dq_all, jnp.zeros((b, tile, h, dk_dim), jnp.float32), jnp.zeros((b, tile, h, dv_dim), jnp.float32))
    dq_all, dkj, dvj = jax.lax.fori_loop(j, last[j] + 1, query_tile, init)
    return (dq_all, jax.lax.dynamic_update_slice_in_dim(dk_all, dkj, j * tile, axis=1),
            jax.lax.dynamic_update_slice_in_dim(dv_all, dvj, j * tile, axis=1))

  zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
  dq, dk, dv = jax.lax.fori_loop(0, n, key_tile, zeros)
  return dq, dk, dv, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


# --- splash (Pallas TPU) ------------------------------------------------------------------------------
def _splash_block(t_pad: int) -> int:
  return next(bl for bl in SPLASH_BLOCKS if t_pad % bl == 0)


@functools.lru_cache(maxsize=32)
def _splash_mask(t_pad: int, heads: int):
  """A causal mask over `t_pad` tokens for each of `heads` heads (hashable: jax caches the NumPy mask
  processing behind a kernel on it)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415 (TPU-only module)
  return splash.MultiHeadMask([splash.CausalMask((t_pad, t_pad)) for _ in range(heads)])


def _splash_kernel(t_pad: int, heads: int, save_residuals: bool, interpret: bool):
  """The splash kernel for a causal mask over `t_pad` tokens, blocks of `_splash_block(t_pad)` for the
  forward and both backward kernels.

  Built anew on every call, inside the caller's trace, and never cached: the kernel holds its mask
  metadata as jax arrays made with `jnp.array` when it is built, so a kernel built under one trace holds
  that trace's values. Kept for another trace (another jit, or the remat / grad sub-traces of one train
  step), they either raise UnexpectedTracerError or become hidden extra inputs of the compiled
  executable, which `jit(...).lower(...).compile()` then cannot be called with ("compiled for N inputs
  but called with N-k", seen on a v5e with jax 0.10.2). Rebuilding costs little: the NumPy processing
  of the (cached, hashable) mask is cached by jax."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415 (TPU-only module)
  bl = _splash_block(t_pad)
  sizes = splash.BlockSizes(block_q=bl, block_kv=bl, block_kv_compute=bl, block_q_dkv=bl, block_kv_dkv=bl,
                            block_kv_dkv_compute=bl, block_q_dq=bl, block_kv_dq=bl)
  return splash.make_splash_mha(_splash_mask(t_pad, heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                save_residuals=save_residuals, interpret=interpret)


def splash_attention(q, k, v, segment_ids, *, scale: float, interpret: bool = False,
                     with_lse: bool = True):
  """The "splash" implementation (module docstring). The row is padded to a multiple of 128 tokens
  (padding tokens, segment 0). `with_lse=False` returns `lse=None` and keeps the kernel differentiable
  (the kernel's residual-saving form has no VJP)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415
  b, t, h, _ = q.shape
  t_pad = -(-t // 128) * 128
  seg = _pad_rows(segment_ids.astype(jnp.int32), t_pad)
  # [B, H, T, D], the query pre-scaled (the kernel applies no scale).
  qh, kh, vh = (jnp.transpose(_pad_rows(x, t_pad), (0, 2, 1, 3)) for x in (q * jnp.asarray(scale, q.dtype), k, v))
  kernel = _splash_kernel(t_pad, h, with_lse, interpret)

  def one_row(qb, kb, vb, sb):
    return kernel(qb, kb, vb, segment_ids=splash.SegmentIds(q=sb, kv=sb))

  out = jax.vmap(one_row)(qh, kh, vh, seg)
  o, lse = (out[0], out[1][0]) if with_lse else (out, None)
  valid = (segment_ids > 0)
  o = jnp.where(valid[:, :, None, None], jnp.transpose(o, (0, 2, 1, 3))[:, :t].astype(jnp.float32), 0.0)
  if lse is not None:
    lse = jnp.where(valid[:, None, :], lse[:, :, :t].astype(jnp.float32), NEG)
  return o, lse
