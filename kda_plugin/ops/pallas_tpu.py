"""Pallas TPU (Mosaic) megakernel for packed-sequence KDA inference with native segment IDs.

Grid `(B, H, S)`: batch and head are parallel; the step axis is sequential ("arbitrary") and walks the
pieces of the packed row in order (schedule: `_segment_schedule`). All steps of one chunk share the
chunk's input blocks; the chunk matrices are built on its first step, each piece then applies its own
incoming state (the carried state in VMEM scratch when it continues the previous chunk, its slot's
`initial_state` block otherwise), and the chunk's output block is written on its last step.

Per-slot final states: the final-state output is aliased to the initial states (zeros when none),
and its block index is the scalar-prefetched slot of the next piece that ends a document; the block
stays resident (no write-back) until that step writes it, and slots that never appear are never
visited, so they keep their initial state. No dynamic slicing happens inside the kernel.

Layouts (prepared by `kda_plugin.ops.inference`): q, k, g `[B, Tp, H*Kp]`, v and o `[B, Tp, H*Vp]`
(free reshapes of `[B, T, H, K]`, with K, V padded to multiples of 128 and T to a multiple of 64),
beta `[B, H, Tp, 1]`, segment map as a column `[B, Tp, 1]` and a row `[B, NC, 1, C]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops import _segment_schedule as ss

C = ss.CHUNK
LANE = 128
MAX_KV = 256  # K and V padded above this would overflow the VMEM plan (states are [Kp, Vp] float32)


def _kernel(sched_ref, *refs, n_steps, scale, use_l2norm, gate, lower_bound, has_h0, want_final,
            key_dim, out_dtype):
  r = cm.unpack_refs(refs, gate=gate, has_h0=has_h0, want_final=want_final)
  q_ref, k_ref, v_ref, g_ref, beta_ref, segc_ref, segr_ref = r[:7]
  aexp_ref, dtb_ref, h0_ref, o_ref, fs_ref = r.a_exp, r.dt_bias, r.h0, r.o, r.final
  carry_ref, g_scr, q_scr, k_scr, tinv_scr, aqk_scr, u_scr, vacc_scr, oacc_scr = r.rest

  b, s = pl.program_id(0), pl.program_id(2)
  base = (b * n_steps + s) * ss.NUM_FIELDS
  fld = lambda f: sched_ref[base + f]
  label, first, last = fld(ss.F_LABEL), fld(ss.F_FIRST), fld(ss.F_LAST)
  live = label != 0

  @pl.when(fld(ss.F_FIRST_OF_CHUNK) == 1)
  def _():
    vacc_scr[...] = jnp.zeros_like(vacc_scr)
    oacc_scr[...] = jnp.zeros_like(oacc_scr)

  @pl.when((fld(ss.F_FIRST_OF_CHUNK) == 1) & live)
  def _():
    seg_col = segc_ref[...]
    valid_row = seg_col != 0
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    if use_l2norm:
      q, k = cm.l2norm_rows(q), cm.l2norm_rows(k)
    q = q * scale
    g = g_ref[...].astype(jnp.float32)
    if gate:
      g = cm.activate_gate(g, aexp_ref[...], dtb_ref[...], lower_bound)
      g = jnp.where(cm.iota(g.shape, 1) < key_dim, g, 0.0)  # padded lanes stay at g = 0
    g = jnp.where(valid_row, g, 0.0)
    beta = jnp.where(valid_row, beta_ref[...].astype(jnp.float32), 0.0)
    G, tinv, aqk = cm.chunk_prep(q, k, g, beta, seg_col, segr_ref[...], blocked=True)
    g_scr[...] = G
    q_scr[...] = q
    k_scr[...] = k
    tinv_scr[...] = tinv
    aqk_scr[...] = aqk
    u_scr[...] = cm.dot(tinv, beta * v_ref[...].astype(jnp.float32))

  mask = segc_ref[...] == label

  def finish(vnew, s_base):
    vacc_scr[...] += vnew
    need_state = (fld(ss.F_ENDS) == 1) | (fld(ss.F_OPEN_END) == 1)

    @pl.when(need_state)
    def _():
      s_end = s_base + cm.piece_state_update(g_scr[...], k_scr[...], mask, last, vnew)
      if want_final:
        @pl.when(fld(ss.F_ENDS) == 1)
        def _():
          fs_ref[...] = s_end

      @pl.when(fld(ss.F_OPEN_END) == 1)
      def _():
        carry_ref[...] = s_end

  @pl.when(live & (fld(ss.F_HAS_STATE) == 1))
  def _():
    if has_h0:
      s_in = jnp.where(fld(ss.F_CONT) == 1, carry_ref[...], h0_ref[...])
    else:
      s_in = carry_ref[...]
    beta = jnp.where(segc_ref[...] != 0, beta_ref[...].astype(jnp.float32), 0.0)
    vnew, o_add, s_base = cm.piece_with_state(g_scr[...], q_scr[...], k_scr[...], beta, tinv_scr[...],
                                              u_scr[...], mask, first, last, s_in)
    oacc_scr[...] += o_add
    finish(vnew, s_base)

  @pl.when(live & (fld(ss.F_HAS_STATE) == 0))
  def _():
    finish(jnp.where(mask, u_scr[...], 0.0), jnp.zeros(carry_ref.shape, jnp.float32))

  if want_final:
    @pl.when(fld(ss.F_PASSTHROUGH) == 1)
    def _():
      fs_ref[...] = h0_ref[...] if has_h0 else jnp.zeros(fs_ref.shape, jnp.float32)

  @pl.when(fld(ss.F_LAST_OF_CHUNK) == 1)
  def _():
    o = oacc_scr[...] + cm.dot(aqk_scr[...], vacc_scr[...])
    o_ref[...] = jnp.where(segc_ref[...] != 0, o, 0.0).astype(out_dtype)


def kda_pallas_tpu(q2, k2, v2, g2, beta4, segc, segr, sched, *, num_heads, key_dim, num_segments,
                   n_steps, scale, use_l2norm, a_exp=None, dt_bias=None, lower_bound=None,
                   initial_state=None, want_final=False, interpret=False):
  """Runs the Mosaic kernel on prepared operands (see the module docstring for layouts).

  Args:
    q2, k2, g2: `[B, Tp, H*Kp]`; v2: `[B, Tp, H*Vp]`; beta4: `[B, H, Tp, 1]`.
    segc: int32 `[B, Tp, 1]`; segr: int32 `[B, NC, 1, C]`; sched: int32 `[B * S * NUM_FIELDS]`.
    a_exp, dt_bias: float32 `[H, 1, Kp]` (in-kernel gate) or None.
    initial_state: float32 `[B, N, H, Kp, Vp]` or None.
    interpret: False, or a `pltpu.InterpretParams` to simulate the TPU on CPU.

  Returns:
    (o `[B, Tp, H*Vp]` in q's dtype, final `[B, N, H, Kp, Vp]` float32 or None).
  """
  bsz, tp, hk = q2.shape
  kp = hk // num_heads
  vp = v2.shape[2] // num_heads
  nsl = num_segments
  gate = a_exp is not None
  has_h0 = initial_state is not None
  nf = ss.NUM_FIELDS

  def at(f):
    return lambda b, h, s, sc: sc[(b * n_steps + s) * nf + f]

  chunk = at(ss.F_CHUNK)
  h0_slot = at(ss.F_H0_SLOT)
  out_slot = at(ss.F_OUT_SLOT)
  blk_k = pl.BlockSpec((None, C, kp), lambda b, h, s, sc: (b, chunk(b, h, s, sc), h))
  blk_v = pl.BlockSpec((None, C, vp), lambda b, h, s, sc: (b, chunk(b, h, s, sc), h))
  in_specs = [blk_k, blk_k, blk_v, blk_k,
              pl.BlockSpec((None, None, C, 1), lambda b, h, s, sc: (b, h, chunk(b, h, s, sc), 0)),
              pl.BlockSpec((None, C, 1), lambda b, h, s, sc: (b, chunk(b, h, s, sc), 0)),
              pl.BlockSpec((None, None, 1, C), lambda b, h, s, sc: (b, chunk(b, h, s, sc), 0, 0))]
  operands = [q2, k2, v2, g2, beta4, segc, segr]
  if gate:
    gspec = pl.BlockSpec((None, 1, kp), lambda b, h, s, sc: (h, 0, 0))
    in_specs += [gspec, gspec]
    operands += [a_exp, dt_bias]
  state_blk = (None, None, None, kp, vp)
  aliases = {}
  if has_h0:
    in_specs.append(pl.BlockSpec(state_blk, lambda b, h, s, sc: (b, h0_slot(b, h, s, sc), h, 0, 0)))
    operands.append(initial_state)
  elif want_final:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(jnp.zeros((bsz, nsl, num_heads, kp, vp), jnp.float32))
  if want_final:
    aliases = {len(operands): 1}  # operand index counts the scalar-prefetch array first

  out_shape = [jax.ShapeDtypeStruct((bsz, tp, num_heads * vp), q2.dtype)]
  out_specs = [pl.BlockSpec((None, C, vp), lambda b, h, s, sc: (b, chunk(b, h, s, sc), h))]
  if want_final:
    out_shape.append(jax.ShapeDtypeStruct((bsz, nsl, num_heads, kp, vp), jnp.float32))
    out_specs.append(pl.BlockSpec(state_blk, lambda b, h, s, sc: (b, out_slot(b, h, s, sc), h, 0, 0)))

  f32 = jnp.float32
  scratch = [pltpu.VMEM((kp, vp), f32),  # carried state of the document open at the chunk's end
             pltpu.VMEM((C, kp), f32), pltpu.VMEM((C, kp), f32), pltpu.VMEM((C, kp), f32),  # G, q~, k
             pltpu.VMEM((C, C), f32), pltpu.VMEM((C, C), f32),  # (I + beta Akk)^-1, Aqk
             pltpu.VMEM((C, vp), f32), pltpu.VMEM((C, vp), f32), pltpu.VMEM((C, vp), f32)]  # U, Vnew, O
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(bsz, num_heads, n_steps), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch)
  kernel = functools.partial(
      _kernel, n_steps=n_steps, scale=float(scale), use_l2norm=use_l2norm, gate=gate,
      lower_bound=lower_bound, has_h0=has_h0, want_final=want_final, key_dim=key_dim,
      out_dtype=q2.dtype)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid_spec=grid_spec, input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes(kp, vp)),
      interpret=interpret, name="kda_inference_tpu")(sched, *operands)
  return outs[0], (outs[1] if want_final else None)


def vmem_limit_bytes(kp: int, vp: int) -> int:
  """VMEM plan: double-buffered input/output blocks + state blocks + scratch, with 2x headroom
  for the kernel's temporaries (score blocks, exponent tiles), at least 32 MiB."""
  f4 = 4
  blocks = 2 * (3 * C * kp + 2 * C * vp + 3 * C * LANE) * f4
  states = 2 * 2 * kp * vp * f4 + kp * vp * f4
  scratch = (3 * C * kp + 2 * C * C + 3 * C * vp) * f4
  return max(32 << 20, 2 * (blocks + states + scratch) + (8 << 20))
