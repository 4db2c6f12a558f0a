"""The `pallas_tpu` implementation of `kda_chunked` (training): the Mosaic forward, a chunked backward.

Forward: the inference kernel (`pallas_tpu.kda_pallas_tpu`) with `want_states`: o, plus the state
entering every 64-row chunk `[NC, B, H, K, V]` float32, the only residual beyond the inputs.

Backward: one reverse `lax.scan` over the chunks. Step c reads chunk c's rows from the operands in
place (a dynamic slice, made head-major only there), recomputes its state-independent matrices
(gates, scores, the unit-lower inverse: `chunked.chunk_matrices`), applies the
saved state entering it (`chunked.chunk_with_state`) and takes that chunk's vector-Jacobian product
with the cotangents of its output rows and of the state leaving it, writing its gradients into
full-size accumulators in place; the state's cotangent is the carry. Memory beyond the inputs and
gradients: the states and one chunk's working set. These are the same per-chunk operations as the
XLA op (`kda_chunk_core`), whose autodiff backward does the same per step, but the states come from
the kernel instead of an XLA forward scan: under the model's remat the layer's forward runs twice
(once for the loss, once to rebuild the residuals), both times through the kernel.

Exactness: the gradient is the XLA chunk math's at the kernel's states; the kernel's states equal
the XLA op's to float32 rounding (float32 inputs) or to its bf16 MXU passes (bf16 inputs,
`pallas_tpu.matmul_precision`), tests/kernels/test_chunked_tpu.py.

Limits: no initial state and no final state (a training step's packed rows); the kernel's
(`inference_tpu.check`): K and V up to 256 after padding, a TPU target unless interpreted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kda_plugin.ops import chunked as ch
from kda_plugin.ops import inference_tpu
from kda_plugin.ops._chunk_common import CHUNK as C
from kda_plugin.ops._contract import InferenceCall


def _layout(x, nc):
  """`[B, T, ...]` -> `[NC, B, C, ...]`, T padded to NC * C with zeros."""
  b, t = x.shape[:2]
  pad = nc * C - t
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((b, nc, C) + x.shape[2:]), 1, 0)


def _chunk_local(s, q, k, v, g, beta, a_log, dt_bias, seg, cont_lab, last_is_cont, *, scale,
                 lower_bound, use_l2norm, inverse):
  """One chunk as the XLA op computes it from the state `s` entering it: `(s_next, o [B, C, H, V])`.

  q, k, g `[B, C, H, K]`, v `[B, C, H, V]`, beta `[B, C, H]` (the caller's dtypes); a_log `[H]` and
  dt_bias `[H, K]` float32 or both None (g already activated); seg `[B, C]`; cont_lab, last_is_cont
  `[B]` (`chunked.carry_schedule`).
  """
  gate = None if a_log is None else (a_log, dt_bias)
  prep = ch.chunk_prep(gate, lower_bound, use_l2norm)
  cp, aqk, linv = ch.chunk_matrices(q, k, v, g, beta, seg, scale=scale, prep=prep, inverse=inverse)
  s_next, o, _, _ = ch.chunk_with_state(cp, aqk, linv, s, seg, cont_lab, last_is_cont, None,
                                        lax.Precision.HIGHEST)
  return s_next, jnp.swapaxes(o, 1, 2)


def _forward(q, k, v, g, beta, seg, a_log, dt_bias, *, num_heads, num_segments, scale, lower_bound,
             use_l2norm, interpret):
  gate = None if a_log is None else (a_log, dt_bias)
  o, _, states = inference_tpu.forward(
      q, k, v, g, beta, seg, None, gate, num_heads=num_heads, num_segments=num_segments, scale=scale,
      lower_bound=lower_bound, use_l2norm=use_l2norm, want_final=False, want_states=True,
      interpret=interpret)
  return o, states


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _train_op(q, k, v, g, beta, seg, a_log, dt_bias, num_heads, num_segments, scale, lower_bound,
              use_l2norm, interpret):
  return _forward(q, k, v, g, beta, seg, a_log, dt_bias, num_heads=num_heads, num_segments=num_segments,
                  scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm, interpret=interpret)[0]


def _train_op_fwd(q, k, v, g, beta, seg, a_log, dt_bias, num_heads, num_segments, scale, lower_bound,
                  use_l2norm, interpret):
  o, states = _forward(q, k, v, g, beta, seg, a_log, dt_bias, num_heads=num_heads,
                       num_segments=num_segments, scale=scale, lower_bound=lower_bound,
                       use_l2norm=use_l2norm, interpret=interpret)
  return o, (q, k, v, g, beta, seg, a_log, dt_bias, states)


def _train_op_bwd(num_heads, num_segments, scale, lower_bound, use_l2norm, interpret, res, do):
  del num_segments, interpret
  q, k, v, g, beta, seg, a_log, dt_bias, states = res
  b, t = q.shape[:2]
  nc = states.shape[0]
  segc = _layout(jnp.broadcast_to(seg, (b, t)).astype(jnp.int32), nc)
  cont_lab, last_is_cont, _ = ch.carry_schedule(segc)
  has_gate = a_log is not None
  local = functools.partial(_chunk_local, scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm,
                            inverse=ch.inverse_form())
  # Each step reads its chunk's rows from the operands as they are (a dynamic slice, made head-major
  # there: [B, C, H*D] -> [B, C, H, D]) and writes its gradients into full-size accumulators in place,
  # so no relaid-out copy of q, k, v, g or do, nor of the gradients, is ever whole in memory.
  pad = nc * C - t
  padded = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x
  ops = tuple(padded(x) for x in (q, k, v, g, beta, do))

  def rows(x, c):
    return lax.dynamic_slice_in_dim(x, c * C, C, axis=1)

  def step(carry, xs):
    ds, d_alog, d_dt, acc = carry
    c, s_in, sx, cl, lic = xs
    chunk = [rows(x, c) for x in ops]
    qc, kc, vc, gc = (x.reshape(x.shape[:2] + (num_heads, -1)) if x.ndim == 3 else x for x in chunk[:4])
    f = lambda s_, q_, k_, v_, g_, b_, a_, d_: local(s_, q_, k_, v_, g_, b_, a_, d_, sx, cl, lic)
    _, vjp = jax.vjp(f, s_in, qc, kc, vc, gc, chunk[4], a_log, dt_bias)
    doc = chunk[5]
    doc = doc.reshape(doc.shape[:2] + (num_heads, -1)) if doc.ndim == 3 else doc
    ds_in, *grads, da, dd = vjp((ds, doc.astype(jnp.float32)))
    acc = tuple(lax.dynamic_update_slice_in_dim(a, gr.reshape(a.shape[:1] + gr.shape[1:2] + a.shape[2:]),
                                                c * C, axis=1)
                for a, gr in zip(acc, grads))
    if has_gate:
      d_alog, d_dt = d_alog + da, d_dt + dd
    return (ds_in, d_alog, d_dt, acc), None

  zeros_or_none = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
  acc0 = tuple(jnp.zeros(x.shape, x.dtype) for x in ops[:5])
  init = (jnp.zeros(states.shape[1:], jnp.float32), zeros_or_none(a_log), zeros_or_none(dt_bias), acc0)
  xs = (jnp.arange(nc), states, segc, cont_lab, last_is_cont)
  (_, d_alog, d_dt, acc), _ = lax.scan(step, init, xs, reverse=True)
  dq, dk, dv, dg, db = (a[:, :t] for a in acc)
  cast = lambda d, x: None if x is None else d.astype(x.dtype)
  return (dq, dk, dv, dg, db, np.zeros(seg.shape, jax.dtypes.float0), cast(d_alog, a_log),
          cast(d_dt, dt_bias))


_train_op.defvjp(_train_op_fwd, _train_op_bwd)


def run(q, k, v, g, beta, seg, gate, *, num_heads, num_segments, scale, lower_bound, use_l2norm,
        interpret):
  """o of the training op (differentiable in q, k, v, g, beta and the gate's a_log, dt_bias).

  Args:
    q, k, g: `[B, T, H, K]` or lane-dense `[B, T, H*K]` (with `num_heads`); v likewise; beta
      `[B, T, H]`; any float dtype the kernel takes (float32, bfloat16).
    seg: int32 `[B, T]` or `[1, T]` (shared) labels, 0 = padding; num_segments: N >= every label
      (static: it sizes the kernel's per-chunk piece tables).
    gate: `(a_log [H], dt_bias [H, K])` float32 (g is the raw gate input) or None (g activated).
    num_heads: H (static). scale: static float. lower_bound: static float or None.
    use_l2norm: L2-normalise q and k in the op. interpret: False or a `pltpu.InterpretParams`.

  Returns:
    o in q's layout and dtype.
  """
  a_log, dt_bias = (None, None) if gate is None else gate
  return _train_op(q, k, v, g, beta, seg, a_log, dt_bias, num_heads, num_segments, scale, lower_bound,
                   use_l2norm, interpret)


def run_validated(p, q, k, v, g, beta, segment_ids, initial_state, output_final_state, scale, a_log, dt_bias,
                  lower_bound, use_qk_l2norm, num_heads, interpret):
  """`kda_chunked(implementation="pallas_tpu")` on arguments `kda_chunked` validated into the
  `KDAProblem` p: `(o, None)`.

  Raises:
    ValueError: initial_state or output_final_state given; the kernel's limits (`inference_tpu.check`).
    RuntimeError: a target that is not a TPU, without interpret.
  """
  if initial_state is not None or output_final_state:
    raise ValueError("kda_chunked(implementation='pallas_tpu') trains without states: pass neither "
                     "initial_state nor output_final_state (or use implementation='xla')")
  call = InferenceCall(p, q, k, v, g, beta, segment_ids, None, False, scale, a_log, dt_bias, lower_bound,
                       bool(use_qk_l2norm), lane_dense=num_heads is not None, interpret=interpret)
  inference_tpu.check(call)
  seg = call.kernel_segment_ids()
  if seg is None:
    seg = jnp.ones((1, p.seq_len), jnp.int32)
  o = run(q, k, v, g, beta, seg, call.kernel_gate(), num_heads=p.num_heads, num_segments=call.num_slots,
          scale=call.kernel_scale(), lower_bound=lower_bound, use_l2norm=bool(use_qk_l2norm),
          interpret=interpret)
  return o, None
