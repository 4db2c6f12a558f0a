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


# Chunk-heads (chunks x batch rows x heads) one backward step works on at once: the step's working set
# is ~2.8 MB per chunk-head (compiled for v5e: 5.7 GiB for 2048), so groups of 256 keep a layer's
# backward near 0.7 GiB beyond its inputs, while each step's operations stay large.
GROUP_CHUNK_HEADS = 256


def chunks_per_group(nc, b, h, budget=None):
  """The largest divisor W of NC with `W * B * H <= budget` (`GROUP_CHUNK_HEADS`), at least 1."""
  budget = GROUP_CHUNK_HEADS if budget is None else budget
  return max([w for w in range(1, nc + 1) if nc % w == 0 and w * b * h <= budget] or [1])


def _train_op_bwd(num_heads, num_segments, scale, lower_bound, use_l2norm, interpret, res, do):
  del num_segments, interpret
  q, k, v, g, beta, seg, a_log, dt_bias, states = res
  b, t = q.shape[:2]
  nc = states.shape[0]
  w = chunks_per_group(nc, b, num_heads)
  ng = nc // w
  segc = _layout(jnp.broadcast_to(seg, (b, t)).astype(jnp.int32), nc)
  cont_lab, last_is_cont, _ = ch.carry_schedule(segc)
  has_gate = a_log is not None
  inverse = ch.inverse_form()

  def grouped(x):  # [NC, B, ...] -> [NG, W * B, ...]: group i holds chunks i*W .. i*W+W-1 of every row
    return x.reshape((ng, w * b) + x.shape[2:])

  def chunks(x):  # q, k, v, g, do: [B, T, H*D] or [B, T, H, D] -> [NG, W * B, C, H, D]
    x = grouped(_layout(x, nc))
    return x.reshape(x.shape[:3] + (num_heads, -1)) if x.ndim == 4 else x

  ins = tuple(chunks(x) for x in (q, k, v, g, do)) + (grouped(_layout(beta, nc)),)
  sched = (grouped(segc), grouped(cont_lab), grouped(last_is_cont))

  def group_fn(q_, k_, v_, g_, b_, a_, d_, sx, cl, lic):
    """`s -> (s_next, o)` of a group's chunks, and their matrices (`chunked.chunk_matrices`)."""
    p = ch.chunk_prep(None if a_ is None else (a_, d_), lower_bound, use_l2norm)
    mats = ch.chunk_matrices(q_, k_, v_, g_, b_, sx, scale=scale, prep=p, inverse=inverse)
    def apply(s):
      s_next, o, _, _ = ch.chunk_with_state(*mats, s, sx, cl, lic, None, lax.Precision.HIGHEST)
      return s_next, jnp.swapaxes(o, 1, 2)
    return mats, apply

  # 1. Every chunk's share of the state's cotangent, `ds_in = M^T ds_next + R`, group by group.
  def cotangent_map(xs):
    (qg, kg, vg, gg, dog, bg), (sx, cl, lic) = xs
    mats, _ = group_fn(qg, kg, vg, gg, bg, a_log, dt_bias, sx, cl, lic)
    return ch.state_cotangent_map(*mats, sx, cl, lic, jnp.swapaxes(dog, 1, 2).astype(jnp.float32))

  m, r = (x.reshape((nc, b) + x.shape[2:]) for x in lax.map(cotangent_map, (ins, sched)))

  # 2. The state's cotangent leaving every chunk: one [K, K] x [K, V] product a chunk, last to first.
  def back(ds, xs):
    m_c, r_c = xs
    return ch.mm("bhkj,bhkv->bhjv", m_c, ds) + r_c, ds

  _, ds_next = lax.scan(back, jnp.zeros(states.shape[1:], jnp.float32), (m, r), reverse=True)

  # 3. Each group's vector-Jacobian product from the states entering and the cotangents leaving it.
  def group_grads(carry, xs):
    (qg, kg, vg, gg, dog, bg), (sx, cl, lic), s_in, dsg = xs
    def f(s, q_, k_, v_, g_, b_, a_, d_):
      return group_fn(q_, k_, v_, g_, b_, a_, d_, sx, cl, lic)[1](s)
    _, vjp = jax.vjp(f, s_in, qg, kg, vg, gg, bg, a_log, dt_bias)
    _, *grads, da, dd = vjp((dsg, dog.astype(jnp.float32)))
    if has_gate:
      carry = (carry[0] + da, carry[1] + dd)
    return carry, tuple(grads)

  zeros_or_none = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
  (d_alog, d_dt), grads = lax.scan(group_grads, (zeros_or_none(a_log), zeros_or_none(dt_bias)),
                                   (ins, sched, grouped(states), grouped(ds_next)))

  def unchunk(gr, x):  # [NG, W * B, C, ...] -> x's layout [B, T, ...]
    gr = jnp.moveaxis(gr.reshape((nc, b, C) + gr.shape[3:]), 0, 1).reshape((b, nc * C) + gr.shape[3:])
    return gr[:, :t].reshape(x.shape).astype(x.dtype)

  dq, dk, dv, dg, db = (unchunk(gr, x) for gr, x in zip(grads, (q, k, v, g, beta)))
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
