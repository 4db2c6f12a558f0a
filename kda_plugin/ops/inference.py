"""`kda_inference`: forward-only KDA over packed sequences with native segment IDs, one pass.

The op is a dispatcher: it validates the call once (`_contract.check_kda_inputs`, `check_gate_args`)
into an `InferenceCall` and hands it to one implementation of `IMPLEMENTATION_MODULES`. Each
implementation module owns its layout, its limits and its memory model behind the same three entry
points, `check(call)` (raises before lowering), `run(call)` and `peak_memory_bytes(...)`:
- `pallas_tpu`: `kda_plugin.ops.inference_tpu`, the wrapper of the Mosaic kernel (`pallas_tpu`).
- `pallas_gpu`: `kda_plugin.ops.inference_gpu`, the wrapper of the Pallas GPU (Triton) kernels.
- `xla`: `kda_plugin.ops.inference_xla`, the XLA lowering of the same algorithm.
- `auto`: by the target platform (`jax.default_backend()`, or the abstract device's platform under
  `jax.sharding.use_abstract_mesh` when exporting ahead of time): tpu -> pallas_tpu,
  gpu -> pallas_gpu, anything else -> xla.
Nothing falls back silently: an implementation that cannot run the call raises and names the limit.
A module is imported only when chosen (the GPU one imports Triton's Pallas lowering).

Math: docs/kda.md sections 'Token recurrence' and 'Chunked form (WY/UT)', docs/packing.md section
'Segment-native chunk algorithm'. Every 64-token chunk is solved in place whatever it holds (padding,
one document, several documents); documents that start inside a chunk with a non-zero initial state
get one masked matmul each.
"""

from __future__ import annotations

import importlib

import numpy as np

from kda_plugin.ops._contract import InferenceCall, check_gate_args, check_kda_inputs
from kda_plugin.ops._platform import target_platform

# The dispatch table: implementation name -> the module that implements it.
IMPLEMENTATION_MODULES = {"pallas_tpu": "kda_plugin.ops.inference_tpu",
                          "pallas_gpu": "kda_plugin.ops.inference_gpu",
                          "xla": "kda_plugin.ops.inference_xla"}
IMPLEMENTATIONS = ("auto", *IMPLEMENTATION_MODULES)
_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}  # target platform -> implementation; else xla

__all__ = ["IMPLEMENTATIONS", "estimate_peak_memory", "kda_inference", "resolve_implementation",
           "target_platform"]


def resolve_implementation(implementation: str) -> str:
  """Maps `implementation` ("auto" included) to a concrete kernel name; ValueError for unknown names."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  return _AUTO.get(target_platform(), "xla")


def _implementation(implementation):
  """The module of the dispatch table that serves `implementation` (None: "auto")."""
  name = resolve_implementation("auto" if implementation is None else implementation)
  return importlib.import_module(IMPLEMENTATION_MODULES[name])


def kda_inference(q, k, v, g, beta, *, segment_ids=None, initial_state=None, output_final_state=False,
                  scale=None, a_log=None, dt_bias=None, lower_bound=None, use_qk_l2norm=False,
                  max_num_segments=None, num_heads=None, implementation=None, interpret=False):
  """KDA forward over (packed) sequences, equal to `kda_reference`.

  Args:
    q, k: `[B, T, H, K]`, or lane-dense `[B, T, H*K]` with `num_heads=H` (the layout the model's
      projections produce; the TPU kernel reads it without a copy when K is a multiple of 128 and T
      of 64); float32 or bfloat16.
    v: `[B, T, H, V]`, or `[B, T, H*V]` with `num_heads`.
    g: like q: the log-space decay (<= 0), or, when `a_log` is given, the raw gate input activated
      in the kernel (`kda_gate_softplus`, or `kda_gate_bounded` with `lower_bound`).
    beta: `[B, T, H]` in [0, 1].
    segment_ids: int32 `[B, T]` or `[T]` (shared by every row); 0 = padding, label n uses slot n-1.
    initial_state: float32 `[B, N, H, K, V]` with segment_ids, else `[B, H, K, V]`; zeros if None.
    output_final_state: also return the final state(s) (an absent label keeps its initial state).
    scale: query scale (a Python float), default K**-0.5.
    a_log: `[H]` log decay rate per head (turns on the in-kernel gate); dt_bias: `[H*K]` or `[H, K]`.
    lower_bound: static float in [-5, 0) selecting the bounded gate family.
    use_qk_l2norm: L2-normalise q and k per head inside the kernel (eps 1e-6 inside the sqrt).
    max_num_segments: N, static; needed under jit when no initial_state gives it.
    num_heads: H, static; given exactly when q, k, v, g come in the lane-dense 3-D layout.
    implementation: the kernel: "auto" (default: by the target platform, see the module
      docstring), "pallas_tpu", "pallas_gpu" or "xla".
    interpret: run a Pallas kernel in interpret mode (TPU: `pltpu.InterpretParams()`, or pass one).

  Returns:
    `(o, final_state)`: o in q's layout (`[B, T, H, V]`, or `[B, T, H*V]` with `num_heads`) and
    dtype, exactly 0 on padding; final_state float32 in initial_state's layout, or None.

  Raises:
    ValueError / TypeError: invalid inputs (see `check_kda_inputs`), gate parameters without a_log,
      an unknown implementation, a shape beyond the chosen kernel's limit, or (pallas_tpu, before
      lowering) buffers larger than one TPU device's HBM (`inference_tpu.device_hbm_bytes`).
    RuntimeError: a Pallas kernel requested on a platform that cannot run it (without interpret).
  """
  impl = _implementation(implementation)
  g_is_raw = a_log is not None
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale, g_is_raw=g_is_raw,
                       num_heads=num_heads)
  lower_bound = check_gate_args(g_is_raw, a_log, dt_bias, lower_bound, p.num_heads, p.key_dim)
  call = InferenceCall(p, q, k, v, g, beta, segment_ids, initial_state, bool(output_final_state),
                       scale, a_log, dt_bias, lower_bound, bool(use_qk_l2norm),
                       lane_dense=num_heads is not None, interpret=interpret)
  impl.check(call)
  return impl.run(call)


def estimate_peak_memory(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                         output_final_state=False, max_num_segments=None, a_log=None, dt_bias=None,
                         num_heads=None, implementation=None, **unused) -> int:
  """Estimated peak device memory (bytes) of one `kda_inference` call; arrays or ShapeDtypeStructs.

  Each implementation owns its memory model (`peak_memory_bytes` of its module):
  - "pallas_tpu" (`inference_tpu`): a closed form of the HBM buffers alive during the kernel in TPU's
    tiled layout (nothing is compiled), checked against `compiled.memory_analysis()` on v5e, v6e and
    TPU7x by tests/aot/test_tpu_kernel_compile.py.
  - "pallas_gpu" (`inference_gpu`): inputs and outputs as passed plus the kernels' workspace.
  - "xla" (`inference_xla`): measured from the compiled executable on the current platform.
  Shapes are not validated here (ShapeDtypeStructs carry no values); N is max_num_segments, else
  initial_state's slot count, else the largest label of concrete segment_ids (1 without them).
  """
  del unused
  impl = _implementation(implementation)
  shp = lambda x: tuple(np.shape(x))
  lane_dense = num_heads is not None
  if lane_dense:
    b, t, hk = shp(q)
    h = int(num_heads)
    kd, vd = hk // h, shp(v)[2] // h
  else:
    b, t, h, kd = shp(q)
    vd = shp(v)[3]
  n = 1
  if segment_ids is not None:
    if max_num_segments is not None:
      n = int(max_num_segments)
    elif initial_state is not None:
      n = shp(initial_state)[1]
    else:
      n = max(1, int(np.max(np.asarray(segment_ids))))
  return impl.peak_memory_bytes(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                                output_final_state=output_final_state, a_log=a_log, dt_bias=dt_bias,
                                lane_dense=lane_dense, dims=(b, t, h, kd, vd, n))
