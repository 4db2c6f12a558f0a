"""Why the GPU kernels run float32 inputs with TF32x3 matmuls and bfloat16 inputs with one TF32 pass.

Interpret mode emulates the tensor cores' TF32 operand rounding (`_gpu_chunk_math.Dots(emulate=True)`),
so these errors are the device's, up to the order of float32 accumulation. Against the float64 token
recurrence: a single TF32 pass on float32 inputs misses the 1e-4 float32 tolerance; TF32x3 meets it
with a wide margin. (bfloat16 inputs meet their 5e-3 relative tolerance with one pass:
test_inference_numerics.py, case b3_packed_bounded_bf16.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops import _gpu_chunk_math as gm
from kda_plugin.ops.pallas_gpu import kda_inference_gpu
from tests.kernels._cases import PACKED, Case, make_inputs, oracle

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _max_error(passes):
  case = Case("packed_h0", PACKED, num_segments=10, gate="softplus", l2norm=True)
  x = make_inputs(case, seed=1)
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], case.seg, x["h0"], 16 ** -0.5,
                        a_log=x["a_log"], dt_bias=x["dt_bias"], l2norm=True)
  gate = (jnp.asarray(x["a_log"], jnp.float32), jnp.asarray(x["dt_bias"], jnp.float32).reshape(2, 16))
  seg = jnp.broadcast_to(jnp.asarray(case.seg), (1, case.seg.shape[0]))
  o, s = kda_inference_gpu(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), seg,
                           jnp.asarray(x["h0"]), gate, num_segments=10, scale=16 ** -0.5,
                           lower_bound=None, use_l2norm=True, want_final=True, interpret=True,
                           dots=gm.Dots(passes=passes, emulate=True))
  return max(np.abs(np.asarray(o) - ref_o).max(), np.abs(np.asarray(s) - ref_s).max())


def test_float32_needs_tf32x3():
  one_pass, three_pass = _max_error(1), _max_error(3)
  assert one_pass > 1e-4, f"one TF32 pass already meets the float32 tolerance ({one_pass:.1e})"
  assert three_pass <= 1e-5, three_pass
