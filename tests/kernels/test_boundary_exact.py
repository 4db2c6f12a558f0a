"""Nothing crosses a document boundary, and steep gates beside mild ones stay exact, in every
implementation that packs documents (docs/packing.md; docs/kda.md section 'Precision').

1. A very steep decay (log decay -1e4 per row, so exp underflows) on the last rows of one document,
   the next document starting inside the same 64-row chunk: the next document's output and final
   state equal that document run alone (same implementation, same dtype) and the float64 oracle.
   Without restarting the cumulative gate at each document's first row, the next document's gate
   differences cancel against the previous document's -6e4 (float32 ulp there ~4e-3).
2. One document whose chunks mix steep rows (log decay -1e4) with mild ones (-0.6 .. 0): float32
   output and final state within 1e-4 of the float64 oracle at head dim 128.

Implementations: kda_reference (token scan), kda_chunked (training op), kda_inference xla,
pallas_tpu (interpret: the TPU's semantics on CPU; lane-dense [B, T, H*K] and head-major
[B, T, H, K] read in place) and pallas_gpu (interpret).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kda_plugin.ops.chunked import kda_chunked
from kda_plugin.ops.inference import kda_inference
from kda_plugin.ops.reference import kda_reference
from tests.oracles import kda_recurrence_f64

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

STEEP = -1e4
KD = VD = 128
CUT, T = 40, 128  # document 1: rows 0..39; document 2: rows 40..127 (starts inside chunk 0)

# (implementation, layout, heads): head-major in place needs H % 8 == 0 on TPU
# pallas_tpu_device: compiled for the TPU this runs on (tools/bench/tpu_device_check.sh), not interpreted
ON_TPU = pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU (tools/bench/tpu_device_check.sh)")
IMPLS = [("reference", "heads", 2), ("chunked", "heads", 2), ("xla", "heads", 2),
         ("pallas_tpu", "lane_dense", 2), ("pallas_tpu", "heads", 8), ("pallas_gpu", "heads", 2),
         pytest.param("pallas_tpu_device", "lane_dense", 2, marks=ON_TPU),
         pytest.param("pallas_tpu_device", "heads", 8, marks=ON_TPU)]
IMPL_IDS = [f"{c.values[0]}-{c.values[1]}" if hasattr(c, "values") else f"{c[0]}-{c[1]}" for c in IMPLS]


def _inputs(h, g, seed):
  rng = np.random.default_rng(seed)
  t = g.shape[1]
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(rng.standard_normal((1, t, h, KD))), unit(rng.standard_normal((1, t, h, KD)))
  v = rng.standard_normal((1, t, h, VD))
  beta = rng.uniform(0.0, 1.0, (1, t, h))
  h0 = rng.standard_normal((1, 2, h, KD, VD)) * 0.5
  return q, k, v, beta, h0


def _run(impl, layout, x, seg, h0, n, dtype):
  """(o float64 [1, T, H, V], final float64 [1, N, H, K, V]) of one implementation."""
  q, k, v, g, beta = x
  h = q.shape[2]
  cast = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  q, k, v, beta = (jnp.asarray(a.astype(cast)) for a in (q, k, v, beta))
  g = jnp.asarray(g, jnp.float32)
  seg, h0 = jnp.asarray(seg, jnp.int32), jnp.asarray(h0, jnp.float32)
  kw = dict(initial_state=h0, output_final_state=True, segment_ids=seg, max_num_segments=n)
  if impl == "reference":
    o, s = kda_reference(q, k, v, g, beta, **kw)
  elif impl == "chunked":
    o, s = kda_chunked(q, k, v, g, beta, **kw)
  else:
    if layout == "lane_dense":
      flat = lambda a: a.reshape(1, a.shape[1], -1)
      q, k, v, g = flat(q), flat(k), flat(v), flat(g)
      kw["num_heads"] = h
    device = impl == "pallas_tpu_device"
    o, s = kda_inference(q, k, v, g, beta, implementation="pallas_tpu" if device else impl,
                         interpret=impl not in ("xla", "pallas_tpu_device"), **kw)
    o = o.reshape(1, o.shape[1], h, VD)
  return np.asarray(o, np.float64), np.asarray(s, np.float64)


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _with_dtypes(impls, ids):
  """IMPLS x (float32, bfloat16), ids `impl-layout-dtype`. The interpreted kernel on the head-major
  layout (8 heads: ~20 s a dtype) runs float32 under `make test-slow` only; bf16 stays in `make test`."""
  out = []
  for case, name in zip(impls, ids):
    values, marks = (case.values, list(case.marks)) if hasattr(case, "values") else (case, [])
    for dtype in ("float32", "bfloat16"):
      slow = [pytest.mark.slow] if (name, dtype) == ("pallas_tpu-heads", "float32") else []
      out.append(pytest.param(*values, dtype, marks=marks + slow, id=f"{name}-{dtype}"))
  return out


@pytest.mark.parametrize("impl,layout,h,dtype", _with_dtypes(IMPLS, IMPL_IDS))
def test_next_document_equals_it_alone_after_a_steep_decay(impl, layout, h, dtype):
  rng = np.random.default_rng(1)
  g = -rng.uniform(0.0, 0.6, (1, T, h, KD))
  g[:, CUT - 6:CUT] = STEEP  # document 1 ends on six rows whose decay underflows
  q, k, v, beta, h0 = _inputs(h, g, seed=2)
  seg = np.array([1] * CUT + [2] * (T - CUT), np.int32)
  o, s = _run(impl, layout, (q, k, v, g, beta), seg, h0, 2, dtype)
  alone = (q[:, CUT:], k[:, CUT:], v[:, CUT:], g[:, CUT:], beta[:, CUT:])
  seg_alone = np.ones(T - CUT, np.int32)
  o1, s1 = _run(impl, layout, alone, seg_alone, h0[:, 1:2], 1, dtype)
  ref_o, ref_s = kda_recurrence_f64(*alone, seg_alone, h0[:, 1:2], KD ** -0.5)
  o2, s2 = o[:, CUT:], s[:, 1:2]
  if dtype == "float32":
    np.testing.assert_allclose(o2, o1, rtol=0, atol=1e-5, err_msg="output: packed vs alone")
    np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-5, err_msg="final state: packed vs alone")
    np.testing.assert_allclose(o2, ref_o, rtol=0, atol=1e-4)
    np.testing.assert_allclose(s2, ref_s, rtol=0, atol=1e-4)
  else:
    for got, want, what in ((o2, o1, "o vs alone"), (s2, s1, "state vs alone"),
                            (o2, ref_o, "o vs float64"), (s2, ref_s, "state vs float64")):
      assert _rel(got, want) <= 5e-3, f"{what}: relative L2 {_rel(got, want):.2e} > 5e-3"


@pytest.mark.parametrize("impl,layout,h", IMPLS, ids=IMPL_IDS)
def test_steep_gates_beside_mild_ones_in_one_chunk(impl, layout, h):
  rng = np.random.default_rng(3)
  g = -rng.uniform(0.0, 0.6, (1, T, h, KD))
  for rows in (slice(5, 8), slice(20, 21), slice(70, 74), slice(100, 101)):
    g[:, rows] = STEEP
  g[:, 30:34, :, ::2] = STEEP  # steep on half the channels only
  q, k, v, beta, h0 = _inputs(h, g, seed=4)
  seg = np.ones(T, np.int32)
  o, s = _run(impl, layout, (q, k, v, g, beta), seg, h0[:, :1], 1, "float32")
  ref_o, ref_s = kda_recurrence_f64(q, k, v, g, beta, seg, h0[:, :1], KD ** -0.5)
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-4)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-4)
