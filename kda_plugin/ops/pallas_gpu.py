"""Pallas GPU (Triton lowering) kernel for packed-sequence KDA inference with native segment IDs.

Triton programs of one grid run independently, so the sequential walk over chunks lives inside the
kernel: grid `(B, H)`, an outer loop over the chunks of the row (the state of the document open at the
chunk's end is the loop carry) and an inner loop over the pieces of each chunk, read from the same
step schedule as the TPU kernel (`_segment_schedule`) plus `chunk_start [B, NC + 1]` (the first
step of each chunk). Final states are stored at the ending document's slot of the final-state array,
which is aliased to the initial states (zeros when none), so absent labels keep their initial state.
The chunk math is shared with the TPU kernel (`_chunk_math`): scores below the diagonal 16x16 blocks
by matmuls as on TPU, the diagonal blocks by the unblocked builder (all four blocks together in 16
masked iterations, since Triton has no value slicing). Matmuls run in IEEE float32
(`Precision.HIGHEST`, no TF32).

Layouts are those of `pallas_tpu` (prepared by `kda_plugin.ops.inference`), with K and V padded to
powers of two (>= 16) as Triton requires.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops import _segment_schedule as ss

C = ss.CHUNK


def _kernel(sched_ref, cstart_ref, *refs, num_chunks, scale, use_l2norm, gate, lower_bound, has_h0,
            want_final, key_dim, out_dtype):
  r = cm.unpack_refs(refs, gate=gate, has_h0=has_h0, want_final=want_final)
  q_ref, k_ref, v_ref, g_ref, beta_ref, segc_ref, segr_ref = r[:7]
  aexp_ref, dtb_ref, h0_ref, o_ref, fs_ref = r.a_exp, r.dt_bias, r.h0, r.o, r.final
  kp, vp = q_ref.shape[-1], v_ref.shape[-1]

  def chunk_body(c, state):
    rows = pl.ds(pl.multiple_of(c * C, C), C)
    seg_col = segc_ref[rows, :]
    valid_row = seg_col != 0
    q = q_ref[rows, :].astype(jnp.float32)
    k = k_ref[rows, :].astype(jnp.float32)
    if use_l2norm:
      q, k = cm.l2norm_rows(q), cm.l2norm_rows(k)
    q = q * scale
    g = g_ref[rows, :].astype(jnp.float32)
    if gate:
      g = cm.activate_gate(g, aexp_ref[...], dtb_ref[...], lower_bound)
      g = jnp.where(cm.iota(g.shape, 1) < key_dim, g, 0.0)
    g = jnp.where(valid_row, g, 0.0)
    beta = jnp.where(valid_row, beta_ref[rows, :].astype(jnp.float32), 0.0)
    G, tinv, aqk = cm.chunk_prep(q, k, g, beta, seg_col, segr_ref[c], blocked=False)
    u = cm.dot(tinv, beta * v_ref[rows, :].astype(jnp.float32))
    zero_s = jnp.zeros((kp, vp), jnp.float32)
    zero_v = jnp.zeros((C, vp), jnp.float32)

    def piece(step, carry):
      state, vacc, oacc = carry
      fld = lambda f: sched_ref[step, f]
      label, first, last = fld(ss.F_LABEL), fld(ss.F_FIRST), fld(ss.F_LAST)
      live = label != 0
      slot = jnp.maximum(label - 1, 0)
      mask = seg_col == label

      def with_state():
        s_in = state
        if has_h0:
          s_in = jnp.where(fld(ss.F_CONT) == 1, state, h0_ref[slot])
        return cm.piece_with_state(G, q, k, beta, tinv, u, mask, first, last, s_in)

      def without_state():
        return jnp.where(mask, u, 0.0), zero_v, zero_s

      vnew, o_add, s_base = lax.cond(live & (fld(ss.F_HAS_STATE) == 1), with_state, without_state)
      s_end = s_base + cm.piece_state_update(G, k, mask, last, vnew)
      if want_final:
        @pl.when(live & (fld(ss.F_ENDS) == 1))
        def _():
          fs_ref[slot] = s_end

      state = jnp.where(live & (fld(ss.F_OPEN_END) == 1), s_end, state)
      return state, vacc + vnew, oacc + o_add

    state, vacc, oacc = lax.fori_loop(cstart_ref[c], cstart_ref[c + 1], piece,
                                      (state, zero_v, zero_v))
    o = oacc + cm.dot(aqk, vacc)
    o_ref[rows, :] = jnp.where(valid_row, o, 0.0).astype(out_dtype)
    return state

  lax.fori_loop(0, num_chunks, chunk_body, jnp.zeros((kp, vp), jnp.float32))


def chunk_starts(sched, num_chunks):
  """int32 `[B, NC + 1]`: index of each chunk's first step (steps are ordered by chunk)."""
  valid = sched[..., ss.F_VALID] == 1
  chunk = sched[..., ss.F_CHUNK]
  counts = jnp.sum((chunk[..., None] == jnp.arange(num_chunks)) & valid[..., None], axis=1)
  return jnp.concatenate([jnp.zeros_like(counts[:, :1]), jnp.cumsum(counts, axis=1)],
                         axis=1).astype(jnp.int32)


def kda_pallas_gpu(q2, k2, v2, g2, beta4, segc, segr, sched, *, num_heads, key_dim, num_segments,
                   n_steps, scale, use_l2norm, a_exp=None, dt_bias=None, lower_bound=None,
                   initial_state=None, want_final=False, interpret=False, num_warps=8):
  """Runs the Triton kernel on prepared operands (layouts: module docstring and `pallas_tpu`).

  Args:
    q2, k2, g2: `[B, Tp, H*Kp]`; v2: `[B, Tp, H*Vp]`; beta4: `[B, H, Tp, 1]`.
    segc: int32 `[B, Tp, 1]`; segr: int32 `[B, NC, 1, C]`; sched: int32 `[B, S, NUM_FIELDS]`.
    a_exp, dt_bias: float32 `[H, 1, Kp]` (in-kernel gate) or None.
    initial_state: float32 `[B, N, H, Kp, Vp]` or None.
    interpret: run with Pallas' interpreter (any platform).

  Returns:
    (o `[B, Tp, H*Vp]` in q's dtype, final `[B, N, H, Kp, Vp]` float32 or None).
  """
  bsz, tp, hk = q2.shape
  kp = hk // num_heads
  vp = v2.shape[2] // num_heads
  nc = tp // C
  nsl = num_segments
  gate = a_exp is not None
  has_h0 = initial_state is not None
  cstart = chunk_starts(sched, nc)
  nf = ss.NUM_FIELDS
  in_specs = [pl.BlockSpec((None, n_steps, nf), lambda b, h: (b, 0, 0)),
              pl.BlockSpec((None, nc + 1), lambda b, h: (b, 0)),
              pl.BlockSpec((None, tp, kp), lambda b, h: (b, 0, h)),
              pl.BlockSpec((None, tp, kp), lambda b, h: (b, 0, h)),
              pl.BlockSpec((None, tp, vp), lambda b, h: (b, 0, h)),
              pl.BlockSpec((None, tp, kp), lambda b, h: (b, 0, h)),
              pl.BlockSpec((None, None, tp, 1), lambda b, h: (b, h, 0, 0)),
              pl.BlockSpec((None, tp, 1), lambda b, h: (b, 0, 0)),
              pl.BlockSpec((None, nc, 1, C), lambda b, h: (b, 0, 0, 0))]
  operands = [sched, cstart, q2, k2, v2, g2, beta4, segc, segr]
  if gate:
    gspec = pl.BlockSpec((None, 1, kp), lambda b, h: (h, 0, 0))
    in_specs += [gspec, gspec]
    operands += [a_exp, dt_bias]
  state_spec = pl.BlockSpec((None, nsl, None, kp, vp), lambda b, h: (b, 0, h, 0, 0))
  if has_h0:
    in_specs.append(state_spec)
    operands.append(initial_state)
  elif want_final:
    in_specs.append(state_spec)
    operands.append(jnp.zeros((bsz, nsl, num_heads, kp, vp), jnp.float32))
  aliases = {len(operands) - 1: 1} if want_final else {}
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, num_heads * vp), q2.dtype)]
  out_specs = [pl.BlockSpec((None, tp, vp), lambda b, h: (b, 0, h))]
  if want_final:
    out_shape.append(jax.ShapeDtypeStruct((bsz, nsl, num_heads, kp, vp), jnp.float32))
    out_specs.append(state_spec)
  kernel = functools.partial(
      _kernel, num_chunks=nc, scale=float(scale), use_l2norm=use_l2norm, gate=gate,
      lower_bound=lower_bound, has_h0=has_h0, want_final=want_final, key_dim=key_dim,
      out_dtype=q2.dtype)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, num_heads), in_specs=in_specs, out_specs=out_specs,
      input_output_aliases=aliases, interpret=bool(interpret), name="kda_inference_gpu",
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))(*operands)
  return outs[0], (outs[1] if want_final else None)


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def kda_inference_gpu(q, k, v, g, beta, seg, h0, gate, *, num_segments, scale, lower_bound, use_l2norm,
                      want_final, interpret):
  """The `pallas_gpu` implementation of `kda_inference` on validated operands (called under its jit).

  This is the seam between `kda_plugin.ops.inference` (validation, dispatch) and the GPU kernel: the
  layout, padding and schedule of the GPU kernel are this module's business.

  Args:
    q, k, g: `[B, T, H, K]`; v: `[B, T, H, V]`; beta: `[B, T, H]` (public layouts).
    seg: int32 `[B, T]` segment ids, or None (one document per row).
    h0: float32 `[B, N, H, K, V]` initial states or None.
    gate: `(a_log [H], dt_bias [H, K])` float32 for the in-kernel gate, or None.
    num_segments: N (static); scale: float; lower_bound: float or None (bounded gate family).

  Returns:
    (o `[B, T, H, V]` in q's dtype, final float32 `[B, N, H, K, V]` or None).
  """
  b, t, h, kd = q.shape
  vd = v.shape[3]
  kp, vp = max(16, _next_pow2(kd)), max(16, _next_pow2(vd))
  tp = -(-t // C) * C
  nc = tp // C
  if seg is None:
    seg = jnp.ones((b, t), jnp.int32)
  seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, tp - t)))
  pad4 = lambda x, last: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, last - x.shape[3])))
  q2 = pad4(q, kp).reshape(b, tp, h * kp)
  k2 = pad4(k, kp).reshape(b, tp, h * kp)
  g2 = pad4(g, kp).reshape(b, tp, h * kp)
  v2 = pad4(v, vp).reshape(b, tp, h * vp)
  beta4 = jnp.pad(jnp.swapaxes(beta, 1, 2).astype(jnp.float32), ((0, 0), (0, 0), (0, tp - t)))[..., None]
  segc = seg[:, :, None]
  segr = seg.reshape(b, nc, 1, C)
  n_steps = ss.num_steps(tp, num_segments)
  sched = ss.build_schedule(seg, n_steps, has_initial_state=h0 is not None)
  if h0 is not None:
    h0 = jnp.pad(h0.astype(jnp.float32), ((0, 0),) * 3 + ((0, kp - kd), (0, vp - vd)))
  a_exp = dt_row = None
  if gate is not None:
    a_log, dt_bias = gate
    a_exp = jnp.broadcast_to(jnp.exp(a_log)[:, None, None], (h, 1, kp))
    dt_row = jnp.pad(dt_bias, ((0, 0), (0, kp - kd)))[:, None, :]
  o2, final = kda_pallas_gpu(q2, k2, v2, g2, beta4, segc, segr, sched, num_heads=h, key_dim=kd,
                             num_segments=num_segments, n_steps=n_steps, scale=scale,
                             use_l2norm=use_l2norm, a_exp=a_exp, dt_bias=dt_row,
                             lower_bound=lower_bound, initial_state=h0, want_final=want_final,
                             interpret=interpret)
  o = o2.reshape(b, tp, h, vp)[:, :t, :, :vd]
  if final is not None:
    final = final[..., :kd, :vd]
  return o, final
