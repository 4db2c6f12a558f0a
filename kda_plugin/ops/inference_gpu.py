"""The `pallas_gpu` implementation of `kda_inference`: the wrapper around the Pallas Triton kernels.

It owns what is GPU-specific outside the kernels (`kda_plugin.ops.pallas_gpu`): the limits
(`pallas_gpu.check_limits`, a CUDA target unless interpreted), the layout (lane-dense operands split
into heads; padding to the kernels' power-of-two tiles is `pallas_gpu.kda_inference_gpu`'s) and the
memory model (inputs and outputs as passed plus `pallas_gpu.workspace_bytes`). Importing this module
imports Triton's Pallas lowering, so the dispatch table imports it only when it is chosen.

Entry points of the dispatch table (`kda_plugin.ops.inference`): `check(call)`, `run(call)`,
`peak_memory_bytes(...)`; `call` is the validated `_contract.InferenceCall`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops import pallas_gpu
from kda_plugin.ops._platform import target_platform

NAME = "pallas_gpu"


def check(call) -> None:
  """Raises before lowering when the kernels cannot run `call`.

  Raises:
    ValueError: a shape beyond `pallas_gpu.check_limits` (K, V, number of segments).
    RuntimeError: a target platform that is not a GPU, without `interpret`.
  """
  p = call.problem
  pallas_gpu.check_limits(p.key_dim, p.value_dim, p.num_segments or 1)
  platform = target_platform()
  if not call.interpret and platform != "gpu":
    raise RuntimeError(
        f"implementation 'pallas_gpu' needs a CUDA GPU, but the target platform is {platform!r}; "
        "pass interpret=True to run the kernel in interpret mode, or use implementation='xla'")


def run(call):
  """`(o, final_state)` of a validated call (see `kda_inference`)."""
  o, final = _forward(call.q, call.k, call.v, call.g, call.beta, call.kernel_segment_ids(),
                      call.slot_states(), call.kernel_gate(), num_heads=call.problem.num_heads,
                      num_segments=call.num_slots, scale=call.kernel_scale(),
                      lower_bound=call.lower_bound, use_l2norm=bool(call.use_qk_l2norm),
                      want_final=bool(call.output_final_state), interpret=call.interpret)
  return call.unslot_final(o, final)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_segments", "scale", "lower_bound",
                                             "use_l2norm", "want_final", "interpret"))
def _forward(q, k, v, g, beta, seg, h0, gate, *, num_heads, num_segments, scale, lower_bound,
             use_l2norm, want_final, interpret):
  """Splits lane-dense operands into heads, runs the kernels, returns o in the caller's layout."""
  lane_dense = q.ndim == 3
  b, t = q.shape[:2]
  if seg is not None:
    seg = jnp.broadcast_to(seg, (b, t))
  split = lambda x: x.reshape(b, t, num_heads, -1) if lane_dense else x
  o, final = pallas_gpu.kda_inference_gpu(
      split(q), split(k), split(v), split(g), beta, seg, h0, gate, num_segments=num_segments,
      scale=scale, lower_bound=lower_bound, use_l2norm=use_l2norm, want_final=want_final,
      interpret=interpret)
  return (o.reshape(b, t, -1) if lane_dense else o), final


def peak_memory_bytes(q, k, v, g, beta, *, segment_ids, initial_state, output_final_state, a_log,
                      dt_bias, lane_dense, dims) -> int:
  """Inputs and outputs as passed (GPU buffers are row-major, untiled) plus `pallas_gpu.workspace_bytes`
  (the chunk kernel's outputs read by the state pass, the zero-filled padded output and the per-row
  tables). dims: (B, T, H, K, V, N) with N = 1 without segment_ids."""
  del lane_dense
  b, t, h, kd, vd, n = dims
  plain = lambda x: math.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize
  inputs = sum(plain(x) for x in (q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias)
               if x is not None)
  outputs = b * t * h * vd * jnp.dtype(q.dtype).itemsize + (
      b * n * h * kd * vd * 4 if output_final_state else 0)
  return int(inputs + outputs + pallas_gpu.workspace_bytes(b, t, h, kd, vd, q.dtype))
