"""The training op's backward as one Mosaic kernel (`kda_chunked(implementation="pallas_tpu")`).

Grid `(B, H / HG, NC)`: batch and head group parallel, the chunk axis sequential and walked from the
last chunk to the first. Step s takes chunk c = NC - 1 - s of HG heads: for each head it reads the
chunk's rows, the state entering the chunk (the forward kernel's residual, `pallas_tpu` with
`want_states`), the output rows' cotangent and the carried cotangent of the state leaving the chunk
(VMEM scratch), recomputes the chunk from them and takes its vector-Jacobian product
(`_chunk_vjp.chunk_head_vjp`, JAX autodiff traced into the kernel body), writes the rows' gradients
and carries the cotangent of the state entering the chunk to the next step. The gate's parameter
gradients are summed over the chunks in output blocks that stay resident along the chunk axis.
Nothing of a chunk leaves the chip but its gradients: the XLA backward it replaces took ~90 fusions
per chunk step (docs/performance.md).

Layouts (prepared here): q, k, g `[B, Tp, H*Kp]`, v and do `[B, Tp, H*Vp]` (lane-dense, K and V
padded to 128 lanes, T to the 64-row chunk); beta and its gradient `[B, NC, H, 1, C]`; the labels
`[B, NC, 1, C]` float32; the chunk schedule (`chunked.carry_schedule`: the label continued into each
chunk and whether it stays open to the chunk's end) as scalar-prefetch tables `[NC * B]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops import _chunk_vjp as cv
from kda_plugin.ops import chunked as ch
from kda_plugin.ops import inference_tpu
from kda_plugin.ops._chunk_common import CHUNK as C
from kda_plugin.ops.pallas_tpu import heads_per_step

VMEM_LIMIT_BYTES = 100 << 20  # of v5e's 128 MiB: the unrolled VJP of 8 heads keeps many [C, C] values


def _kernel(cl_ref, lic_ref, seg_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, st_ref, do_ref, *refs,
            hg, kp, vp, nb, nc, gate, key_dim, chunk_kw):
  it = iter(refs)
  alog_ref, dtb_ref = (next(it), next(it)) if gate else (None, None)
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref = (next(it) for _ in range(5))
  da_ref, ddt_ref = (next(it), next(it)) if gate else (None, None)
  (ds_scr,) = it
  b, hb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  c = nc - 1 - s
  f32 = jnp.float32

  @pl.when(s == 0)
  def _():
    ds_scr[...] = jnp.zeros(ds_scr.shape, f32)
    if gate:
      da_ref[...] = jnp.zeros(da_ref.shape, f32)
      ddt_ref[...] = jnp.zeros(ddt_ref.shape, f32)

  cont_lab = cl_ref[c * nb + b]
  keep_state = lic_ref[c * nb + b] != 0
  seg_col = cm.row_to_col(seg_ref[...])                                   # [C, 1] float32 labels
  lanes_k = lambda i: slice(i * kp, (i + 1) * kp)
  lanes_v = lambda i: slice(i * vp, (i + 1) * vp)
  gate_rows = lambda i: ((jnp.full((1, kp), jnp.exp(alog_ref[hb * hg + i]), f32),
                          dtb_ref[:, lanes_k(i)]) if gate else (None, None))
  steep = functools.reduce(jnp.logical_or, [
      cv.is_steep(g_ref[:, lanes_k(i)].astype(f32), *gate_rows(i), seg_col, gate=gate,
                  lower_bound=chunk_kw["lower_bound"], key_dim=key_dim) for i in range(hg)])

  def heads(steep_form):
    for i in range(hg):
      a_exp, dtb = gate_rows(i)
      rd = lambda ref, lanes: ref[:, lanes].astype(f32)
      ds_in, dq, dk, dv, dg, dbeta, da, ddt = cv.chunk_head_vjp(
          st_ref[i], rd(q_ref, lanes_k(i)), rd(k_ref, lanes_k(i)), rd(v_ref, lanes_v(i)),
          rd(g_ref, lanes_k(i)), cm.row_to_col(beta_ref[i].astype(f32)), a_exp, dtb,
          rd(do_ref, lanes_v(i)), ds_scr[i], seg_col, cont_lab, keep_state, steep=steep_form,
          **chunk_kw)
      dq_ref[:, lanes_k(i)] = dq.astype(dq_ref.dtype)
      dk_ref[:, lanes_k(i)] = dk.astype(dk_ref.dtype)
      dv_ref[:, lanes_v(i)] = dv.astype(dv_ref.dtype)
      dg_ref[:, lanes_k(i)] = dg.astype(dg_ref.dtype)
      db_ref[i] = cm.col_to_row(dbeta)
      if gate:
        da_ref[:, lanes_k(i)] += jnp.sum(da, axis=0, keepdims=True)
        ddt_ref[:, lanes_k(i)] += jnp.sum(ddt, axis=0, keepdims=True)
      ds_scr[i] = ds_in

  @pl.when(steep)
  def _():
    heads(True)

  @pl.when(jnp.logical_not(steep))
  def _():
    heads(False)


def backward(q, k, v, g, beta, seg, a_log, dt_bias, states, do, *, num_heads, scale, lower_bound,
             use_l2norm, interpret):
  """Gradients of the training op (`chunked_tpu`) from the forward kernel's chunk states.

  Args:
    q, k, g: `[B, T, H, K]` or lane-dense `[B, T, H*K]`; v and do likewise with V; beta `[B, T, H]`;
      seg int32 `[B or 1, T]` labels (0 = padding); a_log float32 `[H]` and dt_bias `[H, K]` (the
      in-op gate; g raw) or both None; states float32 `[NC, B, H, K, V]` (`pallas_tpu` with
      `want_states`); num_heads H; scale, lower_bound, use_l2norm as the forward's.
    interpret: False, or Pallas' interpreter (True or a `pltpu.InterpretParams`) on a CPU.

  Returns:
    `(dq, dk, dv, dg, dbeta, d_alog, d_dt)`: each in its input's layout and dtype (d_alog, d_dt
    float32, None without the gate).
  """
  lane_dense = q.ndim == 3
  b, t = q.shape[:2]
  h = num_heads
  kd = q.shape[-1] // h if lane_dense else q.shape[-1]
  vd = v.shape[-1] // h if lane_dense else v.shape[-1]
  kp, vp = inference_tpu.padded_dims(kd, vd)
  nc = states.shape[0]
  tp = nc * C
  gate = a_log is not None

  def dense(x, d, dp):  # -> [B, Tp, H*Dp]
    x = x.reshape(b, t, h, d)
    if dp != d or tp != t:
      x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, dp - d)))
    return x.reshape(b, tp, h * dp)

  q2, k2, g2 = (dense(x, kd, kp) for x in (q, k, g))
  v2, do2 = dense(v, vd, vp), dense(do, vd, vp)
  segb = jnp.broadcast_to(seg, (b, t)).astype(jnp.int32)
  segb = jnp.pad(segb, ((0, 0), (0, tp - t))) if tp != t else segb
  segc = jnp.moveaxis(segb.reshape(b, nc, C), 1, 0)
  cont_lab, last_is_cont, _ = ch.carry_schedule(segc)
  seg4 = segb.reshape(b, nc, 1, C).astype(jnp.float32)
  beta_p = jnp.pad(beta, ((0, 0), (0, tp - t), (0, 0))) if tp != t else beta
  beta5 = jnp.swapaxes(beta_p.reshape(b, nc, C, h), 2, 3)[:, :, :, None, :]
  if (kp, vp) != (kd, vd):
    states = jnp.pad(states, ((0, 0),) * 3 + ((0, kp - kd), (0, vp - vd)))
  hg = heads_per_step(h, kp, vp)
  rev = lambda s: nc - 1 - s
  blk_k = pl.BlockSpec((None, C, hg * kp), lambda bi, hi, s, *_: (bi, rev(s), hi))
  blk_v = pl.BlockSpec((None, C, hg * vp), lambda bi, hi, s, *_: (bi, rev(s), hi))
  blk_beta = pl.BlockSpec((None, None, hg, 1, C), lambda bi, hi, s, *_: (bi, rev(s), hi, 0, 0))
  in_specs = [pl.BlockSpec((None, None, 1, C), lambda bi, hi, s, *_: (bi, rev(s), 0, 0)),
              blk_k, blk_k, blk_v, blk_k, blk_beta,
              pl.BlockSpec((None, None, hg, kp, vp), lambda bi, hi, s, *_: (rev(s), bi, hi, 0, 0)),
              blk_v]
  operands = [seg4, q2, k2, v2, g2, beta5, states, do2]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q2, k2, v2, g2)]
  out_shape.append(jax.ShapeDtypeStruct(beta5.shape, jnp.float32))
  out_specs = [blk_k, blk_k, blk_v, blk_k, blk_beta]
  if gate:
    dt = jnp.asarray(dt_bias, jnp.float32).reshape(h, kd)
    dt_row = (jnp.pad(dt, ((0, 0), (0, kp - kd))) if kp != kd else dt).reshape(1, h * kp)
    in_specs += [pl.BlockSpec(memory_space=pltpu.SMEM),
                 pl.BlockSpec((1, hg * kp), lambda bi, hi, s, *_: (0, hi))]
    operands += [jnp.asarray(a_log, jnp.float32), dt_row]
    acc = pl.BlockSpec((None, 1, hg * kp), lambda bi, hi, s, *_: (bi, 0, hi))
    out_shape += [jax.ShapeDtypeStruct((b, 1, h * kp), jnp.float32)] * 2
    out_specs += [acc, acc]
  kernel = functools.partial(
      _kernel, hg=hg, kp=kp, vp=vp, nb=b, nc=nc, gate=gate, key_dim=kd,
      chunk_kw=dict(scale=float(scale), use_l2norm=use_l2norm, gate=gate, lower_bound=lower_bound,
                    key_dim=kd, bf16=jnp.dtype(q.dtype) == jnp.bfloat16))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, h // hg, nc), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((hg, kp, vp), jnp.float32)])
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT_BYTES),
      interpret=interpret, name="kda_train_bwd_tpu")(
          cont_lab.reshape(-1).astype(jnp.int32), last_is_cont.reshape(-1).astype(jnp.int32),
          *operands)
  dq2, dk2, dv2, dg2, db5 = outs[:5]

  def undense(x2, d, dp, like):
    x = x2.reshape(b, tp, h, dp)[:, :t, :, :d]
    return x.reshape(like.shape)

  dq, dk, dg = (undense(x2, kd, kp, x) for x2, x in ((dq2, q), (dk2, k), (dg2, g)))
  dv = undense(dv2, vd, vp, v)
  dbeta = jnp.swapaxes(db5[:, :, :, 0, :], 2, 3).reshape(b, tp, h)[:, :t].astype(beta.dtype)
  d_alog = d_dt = None
  if gate:
    da, ddt = outs[5], outs[6]
    d_alog = jnp.sum(da.reshape(b, h, kp), axis=(0, 2)) * jnp.exp(jnp.asarray(a_log, jnp.float32))
    d_dt = jnp.sum(ddt.reshape(b, h, kp), axis=0)[:, :kd].reshape(jnp.shape(dt_bias))
  return dq, dk, dv, dg, dbeta, d_alog, d_dt
