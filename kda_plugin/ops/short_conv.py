"""Depthwise causal short convolution (Kimi-Linear's q/k/v conv, width W = 4) with segment restarts.

`y[t] = act(sum_{j=0}^{W-1} weight[j] * x[t - (W-1) + j])`, where only inputs of t's own segment
count; positions before a segment's first token read that segment's conv cache (zeros by default).
This is PyTorch's `Conv1d(groups=D, padding=W-1)` truncated to T outputs, as in transformers'
Kimi-Linear and fla `ShortConvolution`, with the weight stored `[W, D]` (the checkpoint's
`[D, 1, W]` transposed).

Cache layout: the W-1 inputs that precede the first token, oldest first: `[B, W-1, D]` without
segment_ids, `[B, N, W-1, D]` per state slot with segment_ids (label n uses slot n-1, as for the KDA
state), so a document carried across windows keeps its conv window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x, "identity": lambda x: x}


def _activation(name):
  if name not in _ACTIVATIONS:
    raise ValueError(f"activation must be one of {sorted(str(k) for k in _ACTIVATIONS)}, got {name!r}")
  return _ACTIVATIONS[name]


def _check(x, weight):
  x = jnp.asarray(x)
  weight = jnp.asarray(weight)
  if x.ndim != 3:
    raise ValueError(f"x must have shape [B, T, D], got {x.shape}")
  if weight.ndim != 2 or weight.shape[1] != x.shape[2]:
    raise ValueError(f"weight must have shape [W, D] with D={x.shape[2]}, got {weight.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be floating, got dtype {x.dtype}")
  return x, weight


def short_conv(x, weight, *, segment_ids=None, cache=None, output_final_cache=False,
               max_num_segments=None, activation="silu"):
  """Causal depthwise convolution over a (possibly packed) sequence.

  Args:
    x: `[B, T, D]`.
    weight: `[W, D]`; tap W-1 multiplies the current token.
    segment_ids: int32 `[B, T]` or `[T]`; 0 = padding (output 0); the window restarts at each
      segment's first token.
    cache: `[B, W-1, D]` (no segment_ids) or `[B, N, W-1, D]` (per slot); zeros if None.
    output_final_cache: also return the updated cache in the same layout.
    max_num_segments: N when segment_ids is given; inferred from cache or concrete ids when None.
    activation: "silu" (Kimi-Linear) or None.

  Returns:
    `(y, final_cache | None)`; y `[B, T, D]` in x's dtype (computed in float32).

  Raises:
    ValueError: bad shapes, or N missing when it cannot be inferred.
  """
  x, weight = _check(x, weight)
  act = _activation(activation)
  b, t, d = x.shape
  w = weight.shape[0]
  wf = weight.astype(jnp.float32)
  xf = x.astype(jnp.float32)
  if segment_ids is None:
    if cache is None:
      cache = jnp.zeros((b, w - 1, d), jnp.float32)
    if tuple(cache.shape) != (b, w - 1, d):
      raise ValueError(f"cache must have shape [B, W-1, D] = {(b, w - 1, d)}, got {tuple(cache.shape)}")
    xp = jnp.concatenate([cache.astype(jnp.float32), xf], axis=1)
    y = sum(wf[j] * xp[:, j:j + t] for j in range(w))
    y = act(y).astype(x.dtype)
    return y, (xp[:, t:] if output_final_cache else None)

  seg = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  if max_num_segments is None:
    if cache is not None:
      max_num_segments = cache.shape[1]
    elif not isinstance(segment_ids, jax.core.Tracer):
      max_num_segments = max(1, int(jnp.max(seg)))
    else:
      raise ValueError("max_num_segments is required for traced segment_ids without a cache")
  n = int(max_num_segments)
  fresh = cache is None  # every document starts with a zero window: no tap reads a cache
  if cache is None:
    cache = jnp.zeros((b, n, w - 1, d), jnp.float32)
  if tuple(cache.shape) != (b, n, w - 1, d):
    raise ValueError(f"with segment_ids, cache must have shape [B, N, W-1, D] = {(b, n, w - 1, d)}, "
                     f"got {tuple(cache.shape)}")
  cache = cache.astype(jnp.float32)
  pos = jnp.arange(t)
  first = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  start = lax.cummax(jnp.where(first, pos, 0), axis=1)            # first index of t's run
  offset = pos - start                                             # position inside the run
  # Taps inside the run read x shifted by a static amount (pad and slice: XLA fuses them into the
  # sum, no gather and no [B, T, D] copy per tap).
  y = jnp.zeros((b, t, d), jnp.float32)
  for back in range(w):                                            # tap reading x[t - back]
    shifted = xf if back == 0 else jnp.pad(xf, ((0, 0), (back, 0), (0, 0)))[:, :t]
    y = y + jnp.where((back <= offset)[..., None], wf[w - 1 - back] * shifted, 0.0)
  # Taps before the run read the slot's cache. Without a cache they add nothing and are skipped
  # (training: a zero cache's taps were kept from the forward to the backward pass). Only a run's
  # first W-1 tokens have such taps, and they depend only on (slot, offset): summed per slot first
  # ([B, N, W-1, D]), then added onto y at those B*N*(W-1) positions (a scatter-add into y). Not a
  # [B, T, D] gather by (slot, offset): that depends on the weights and the cache alone, so XLA may
  # compute every layer's copy before the first layer runs and hold them all (60 f32 [8192, 4096] in
  # an 8192-token prefill of the 48B shard, 7.3 GiB); the scatter reads y and so runs in its layer.
  labels = jnp.arange(1, n + 1)
  is_lab = seg[:, None, :] == labels[None, :, None]                 # [B, N, T]
  present = jnp.any(is_lab, axis=2)
  if w > 1 and not fresh:
    before = jnp.stack([sum(wf[w - 1 - back] * cache[:, :, w - 1 - back + o]
                            for back in range(o + 1, w)) for o in range(w - 1)], axis=2)
    first_pos = jnp.argmax(is_lab, axis=2)                          # [B, N] first token of slot's run
    at = first_pos[..., None] + jnp.arange(w - 1)                   # [B, N, W-1]
    inside = present[..., None] & (at < t)
    inside = inside & (jnp.take_along_axis(seg, jnp.clip(at, 0, t - 1).reshape(b, -1), axis=1)
                       .reshape(at.shape) == labels[None, :, None])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], at.shape)
    at = jnp.where(inside, at, t)                                   # out of range: dropped
    y = y.at[rows, at].add(before, mode="drop")
  y = jnp.where((seg > 0)[..., None], act(y), 0.0).astype(x.dtype)
  if not output_final_cache:
    return y, None

  last = jnp.max(jnp.where(is_lab, pos, -1), axis=2)              # [B, N]
  length = jnp.sum(is_lab, axis=2)
  i = jnp.arange(w - 1)
  c = length[..., None] + i                                         # index into cache ++ run
  from_run = c >= w - 1
  xi = jnp.clip(last[..., None] - (w - 2) + i, 0, t - 1)           # [B, N, W-1]
  run_vals = xf[jnp.arange(b)[:, None, None], xi]                   # [B, N, W-1, D]
  cache_vals = jnp.take_along_axis(cache, jnp.clip(c, 0, w - 2)[..., None], axis=2)
  new = jnp.where(from_run[..., None], run_vals, cache_vals)
  new = jnp.where(present[..., None, None], new, cache)
  return y, new


def short_conv_step(x, weight, cache, *, activation="silu"):
  """One decode step of `short_conv`.

  Args:
    x: `[B, D]` (or `[B, 1, D]`) the new token's input.
    weight: `[W, D]`.
    cache: `[B, W-1, D]`, the previous W-1 inputs, oldest first.
    activation: "silu" or None.

  Returns:
    `(y, new_cache)`: y like x, in x's dtype; new_cache float32 `[B, W-1, D]`.

  Raises:
    ValueError: a missing cache or mismatched shapes.
  """
  if cache is None:
    raise ValueError("cache is required for a decode step: pass the [B, W-1, D] conv window")
  x = jnp.asarray(x)
  squeeze = x.ndim == 3
  xt = x[:, 0] if squeeze else x
  act = _activation(activation)
  w = weight.shape[0]
  if tuple(cache.shape) != (xt.shape[0], w - 1, xt.shape[1]):
    raise ValueError(f"cache must have shape [B, W-1, D] = {(xt.shape[0], w - 1, xt.shape[1])}, "
                     f"got {tuple(cache.shape)}")
  window = jnp.concatenate([cache.astype(jnp.float32), xt.astype(jnp.float32)[:, None]], axis=1)
  wf = weight.astype(jnp.float32)
  # The W taps summed as W - 1 elementwise adds (one loop fusion) rather than a reduction over the
  # tap axis: XLA:CPU hands that small reduction to a library call costing ~100 us per conv.
  acc = window[:, 0] * wf[0]
  for i in range(1, w):
    acc = acc + window[:, i] * wf[i]
  y = act(acc).astype(x.dtype)
  return (y[:, None] if squeeze else y), window[:, 1:]
