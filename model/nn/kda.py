"""The KDA mixer of Kimi-Linear (docs/kda.md section 'Layer'; transformers `models/kimi_linear`,
Moonshot's `modeling_kimi.py`), with every KDA-specific op taken from an attention backend.

For hidden x `[B, T, d]` (after the block's input RMSNorm), H heads of width K (= V):
1. `q, k, v = SiLU(conv(q_proj x)), ...` (depthwise causal conv per projection, restarting at each
   document; the backend's `short_conv`).
2. raw gate `f_b_proj(f_a_proj x)`, `beta = sigmoid(b_proj x)` (float32).
3. `o = KDA(L2N(q), L2N(k), v, gate(raw; A_log, dt_bias), beta)`: the backend's `kda` (gate and
   L2 norm inside; fused or not is the backend's choice).
4. per head `RMSNorm(o; eps) * o_norm * sigmoid(g_b_proj(g_a_proj x))`, then `o_proj`.

Parameters (HF checkpoint name -> here; `.weight [out, in]` -> `.kernel [in, out]`):
`q_proj/k_proj/v_proj.kernel [d, H*K]`, `q_conv1d/k_conv1d/v_conv1d.kernel [W, H*K]` (HF
`[H*K, 1, W]`), `f_a_proj.kernel [d, K]`, `f_b_proj.kernel [K, H*K]`, `b_proj.kernel [d, H]`,
`g_a_proj.kernel [d, K]`, `g_b_proj.kernel [K, H*K]`, `A_log [H]` float32 (HF `[1, 1, H, 1]`),
`dt_bias [H*K]` float32, `o_norm.scale [K]`, `o_proj.kernel [H*K, d]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.nn import cache as cache_lib
from model import partitioning
from model.nn.layers import RMSNorm, as_dtype, inverse_softplus, linear, param, uniform_init


class ShortConvWeight(nnx.Module):
  """Holds one depthwise conv's taps, `kernel [W, D]` (tap W-1 multiplies the current token)."""

  def __init__(self, width: int, dim: int, args, rngs: nnx.Rngs):
    bound = 1.0 / np.sqrt(width)  # PyTorch Conv1d default: fan_in = in_channels/groups * W = W
    self.kernel = param(uniform_init(-bound, bound), rngs.params(), (width, dim), as_dtype(args.weight_dtype),
                        (None, "heads"))


class KimiDeltaAttention(nnx.Module):
  """KDA mixer (see the module docstring).

  Args:
    args: `model.config.ModelArgs`. backend: the attention backend object (`model.backend`).
    rngs: parameter initialisation keys.
  """

  def __init__(self, args, backend, *, rngs: nnx.Rngs):
    d, h, kd, w = args.hidden_size, args.kda_num_heads, args.kda_head_dim, args.kda_conv_kernel_size
    self.num_heads, self.head_dim, self.conv_width = h, kd, w
    self.lower_bound = args.kda_gate_lower_bound
    self.implementation = args.kda_implementation
    self.dtype = as_dtype(args.dtype)
    self.backend = backend
    proj = h * kd
    self.q_proj = linear(d, proj, ("embed", "heads"), args, rngs)
    self.k_proj = linear(d, proj, ("embed", "heads"), args, rngs)
    self.v_proj = linear(d, proj, ("embed", "heads"), args, rngs)
    self.q_conv1d = ShortConvWeight(w, proj, args, rngs)
    self.k_conv1d = ShortConvWeight(w, proj, args, rngs)
    self.v_conv1d = ShortConvWeight(w, proj, args, rngs)
    self.f_a_proj = linear(d, kd, ("embed", None), args, rngs)
    self.f_b_proj = linear(kd, proj, (None, "heads"), args, rngs)
    self.b_proj = linear(d, h, ("embed", "heads"), args, rngs)
    self.g_a_proj = linear(d, kd, ("embed", None), args, rngs)
    self.g_b_proj = linear(kd, proj, (None, "heads"), args, rngs)
    # A = exp(A_log) in [1, 16] and dt in [1e-3, 1e-1] (log-uniform), the fla / Mamba initialisation.
    a = jax.random.uniform(rngs.params(), (h,), jnp.float32, 1.0, 16.0)
    self.A_log = nnx.Param(jnp.log(a), out_sharding=("heads",))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (proj,), jnp.float32, np.log(1e-3), np.log(1e-1)))
    self.dt_bias = nnx.Param(inverse_softplus(dt), out_sharding=("heads",))
    self.o_norm = RMSNorm(kd, eps=args.rms_norm_eps, param_dtype=as_dtype(args.weight_dtype),
                          dtype=self.dtype, axes=(None,))
    self.o_proj = linear(proj, d, ("heads", "embed"), args, rngs)

  def _heads(self, x):
    return x.reshape(x.shape[:-1] + (self.num_heads, self.head_dim))

  def _output(self, o, x):
    # Gated per-head RMSNorm (fla FusedRMSNormGated, activation sigmoid), then o_proj. o: lane-dense
    # `[..., H*V]` (x's leading dims); the per-head view is index arithmetic inside one fusion.
    o = self._heads(o)
    gate = self._heads(self.g_b_proj(self.g_a_proj(x))).astype(jnp.float32)
    y = self.o_norm.normalize(o) * self.o_norm.scale[...].astype(jnp.float32) * jax.nn.sigmoid(gate)
    y = y.astype(self.dtype)
    return self.o_proj(y.reshape(y.shape[:-2] + (-1,)))

  def __call__(self, x, *, segment_ids, mode: str, num_slots: int, cache=None, lengths=None, return_cache=False,
               cache_length=None):
    """Sequence forward over packed rows (the mixer interface of model/nn/kimi_linear.py).

    Args:
      x: `[B, T, d]` compute dtype. segment_ids: int32 `[B, T]` (0 = padding).
      mode: "train", "eval" or "prefill" (routes the backend's op).
      num_slots: N, document slots per row (static).
      cache: incoming `KDALayerCache` in decode layout (S = B*N) or None (fresh documents).
      lengths, cache_length: unused (the state carries a document's whole past, whatever its length).
      return_cache: also return the final `KDALayerCache` in decode layout.

    Returns:
      `(y [B, T, d], cache | None)`.
    """
    b = x.shape[0]
    be = self.backend
    to_slots = lambda a: None if a is None else cache_lib.rows_to_slots(a, b, num_slots)
    conv_in = (None, None, None) if cache is None else tuple(
        to_slots(c) for c in (cache.conv_q, cache.conv_k, cache.conv_v))
    convs = []
    for proj, conv, cin in ((self.q_proj, self.q_conv1d, conv_in[0]), (self.k_proj, self.k_conv1d, conv_in[1]),
                            (self.v_proj, self.v_conv1d, conv_in[2])):
      convs.append(be.short_conv(proj(x), conv.kernel[...], segment_ids=segment_ids, cache=cin,
                                 max_num_segments=num_slots))
    (q, cq), (k, ck), (v, cv) = convs
    g_raw = self.f_b_proj(self.f_a_proj(x))
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    kd = self.head_dim

    def kernel(q, k, v, g_raw, beta, segment_ids, h0, a_log, dt_bias):
      # q, k, v, g_raw arrive lane-dense [B, T, H*K] as the projections made them (this shard's
      # heads): the TPU kernel reads that layout in place, while [B, T, H, K] would cost a relayout
      # copy of each before the call (TPU tiles (8, 128) cover (T, H*K) in one and (H, K) in the other).
      o, st = be.kda(q, k, v, g_raw, beta, mode=mode, segment_ids=segment_ids, initial_state=h0,
                     output_final_state=return_cache, max_num_segments=num_slots,
                     implementation=self.implementation, num_heads=q.shape[-1] // kd,
                     a_log=a_log, dt_bias=dt_bias, lower_bound=self.lower_bound)
      return (o, st) if return_cache else (o,)

    # Inside a mesh the kernel runs on each device's rows and heads (heads are independent; the
    # lane-dense H*K axis splits on head boundaries, as the projections' "heads" axis does).
    s = partitioning
    lane_dense = s.HEADS_BTH  # [B, T, H*K]: batch, length, heads (x head dim)
    outs = s.per_shard(
        kernel, (q, k, v, g_raw, beta, segment_ids,
                 None if cache is None else to_slots(cache.state), self.A_log[...], self.dt_bias[...]),
        in_axes=(lane_dense,) * 4 + (s.HEADS_BTH, s.BATCH_TOKENS, s.STATE_BNHKV, s.HEAD_PARAM, s.HEAD_PARAM),
        out_axes=(lane_dense, s.STATE_BNHKV)[:1 + bool(return_cache)])
    o, state = outs[0], (outs[1] if return_cache else None)
    y = self._output(o, x)
    if not return_cache:
      return y, None
    rows = cache_lib.slots_to_rows
    return y, cache_lib.KDALayerCache(rows(state), rows(cq), rows(ck), rows(cv))

  def empty_cache(self, num_sequences: int, cache_length: int):
    """A zero `KDALayerCache` for `num_sequences` fresh sequences (`cache_length` unused)."""
    return cache_lib.empty_kda_cache(num_sequences, self.num_heads, self.head_dim, self.conv_width)

  def decode(self, x, cache, lengths=None):
    """One token per sequence.

    Args:
      x: `[S, d]`. cache: `KDALayerCache` (decode layout). lengths: unused.
    Returns:
      `(y [S, d], new KDALayerCache)`.
    """
    be = self.backend
    q, cq = be.short_conv_step(self.q_proj(x), self.q_conv1d.kernel[...], cache.conv_q)
    k, ck = be.short_conv_step(self.k_proj(x), self.k_conv1d.kernel[...], cache.conv_k)
    v, cv = be.short_conv_step(self.v_proj(x), self.v_conv1d.kernel[...], cache.conv_v)
    g_raw = self._heads(self.f_b_proj(self.f_a_proj(x)))
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    def kernel(q, k, v, g_raw, beta, state, a_log, dt_bias):
      return be.kda_decode(q, k, v, g_raw, beta, state, implementation=self.implementation, a_log=a_log, dt_bias=dt_bias,
                           lower_bound=self.lower_bound)

    s = partitioning
    o, state = s.per_shard(
        kernel, (self._heads(q), self._heads(k), self._heads(v), g_raw, beta, cache.state, self.A_log[...],
                 self.dt_bias[...]),
        in_axes=(s.HEADS_SHK,) * 4 + (s.HEADS_SH, s.STATE_SHKV, s.HEAD_PARAM, s.HEAD_PARAM),
        out_axes=(s.HEADS_SHK, s.STATE_SHKV))
    return self._output(o.reshape(o.shape[:-2] + (-1,)), x), cache_lib.KDALayerCache(state, cq, ck, cv)
