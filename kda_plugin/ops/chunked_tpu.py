"""The `pallas_tpu` implementation of `kda_chunked` (training): the Mosaic forward and backward kernels.

Forward: the inference kernel (`pallas_tpu.kda_pallas_tpu`) with `want_states`: o, plus the state
entering every 64-row chunk `[NC, B, H, K, V]` float32, the only residual beyond the inputs.

Backward: one Mosaic kernel (`chunked_tpu_bwd`), walking the chunks from the last to the first: each
grid step recomputes one chunk of a head group from the saved state entering it and takes that
chunk's vector-Jacobian product on chip (`_chunk_vjp`), carrying the state's cotangent in VMEM.
Memory beyond the inputs and gradients: the states. Under the model's remat the layer's forward
runs twice (once for the loss, once to rebuild the residuals), both times through the kernel.

Exactness: the gradient is the float32 chunk math's (the same masked equations as the XLA op) at the
kernel's states; the kernel's states equal the XLA op's to float32 rounding (float32 inputs) or to
its bf16 MXU passes (bf16 inputs, `pallas_tpu.matmul_precision`), tests/kernels/test_chunked_tpu.py.

Limits: no initial state and no final state (a training step's packed rows); the kernel's
(`inference_tpu.check`): K and V up to 256 after padding, a TPU target unless interpreted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops import chunked_tpu_bwd
from kda_plugin.ops import inference_tpu
from kda_plugin.ops._contract import InferenceCall


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
  del num_segments
  q, k, v, g, beta, seg, a_log, dt_bias, states = res
  dq, dk, dv, dg, db, d_alog, d_dt = chunked_tpu_bwd.backward(
      q, k, v, g, beta, seg, a_log, dt_bias, states, do, num_heads=num_heads, scale=scale,
      lower_bound=lower_bound, use_l2norm=use_l2norm, interpret=interpret)
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
    use_l2norm: L2-normalise q and k in the op. interpret: False, True (Pallas' generic
      interpreter, which `jax.checkpoint` can differentiate) or a `pltpu.InterpretParams`.

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
