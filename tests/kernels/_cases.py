"""Hard packed-sequence cases for the inference kernels, and the float64 oracle called as they need it.

The oracle is the shared KDA token recurrence of tests/oracles.py (NumPy float64, its own gate
activation and L2 norm), so it shares no code with the ops.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tests.oracles import gate_f64, kda_recurrence_f64, l2norm_f64


def oracle(q, k, v, g, beta, seg, h0, scale, *, a_log=None, dt_bias=None, lower_bound=None,
           l2norm=False):
  """float64 KDA recurrence per state slot. Shapes as kda_inference; seg `[T]` or `[B, T]`.

  Returns (o `[B, T, H, V]`, final `[B, N, H, K, V]`).
  """
  if a_log is not None:
    g = gate_f64(g, a_log, dt_bias, lower_bound)
  if l2norm:
    q, k = l2norm_f64(q), l2norm_f64(k)
  return kda_recurrence_f64(q, k, v, g, beta, seg, h0, scale)


@dataclasses.dataclass
class Case:
  name: str
  seg: np.ndarray | None  # [T] or None (unpacked)
  batch: int = 1
  heads: int = 2
  key_dim: int = 16
  value_dim: int = 24
  num_segments: int | None = None
  with_h0: bool = True
  gate: str | None = None  # None (pre-activated g), "softplus" or "bounded"
  l2norm: bool = False
  steep: bool = False
  steep_rows: tuple = ()  # (start, stop) row ranges with ~ -20 nats a token, the other rows gentle
  dtype: str = "float32"
  seq_len: int | None = None


def _runs(t, runs):
  seg = np.zeros(t, np.int32)
  for label, start, stop in runs:
    seg[start:stop] = label
  return seg


# chunk 0: a document, two runs of length 1, a document, padding, a document ending on row 63;
# chunk 1: padding only; chunk 2: a document and one that continues into chunk 3; trailing padding.
# Labels 4, 9, 10 never appear (their slots keep the initial state).
PACKED = _runs(200, [(2, 0, 10), (5, 10, 11), (6, 11, 12), (3, 12, 31), (7, 34, 64),
                     (1, 128, 171), (8, 171, 196)])
# Cases sharing (B, T, H, K, V, N, flags) share one compilation (the segment map is traced).
CASES = [
    Case("packed_h0", PACKED, num_segments=10),
    # only labels 2 and 3 present: slot 0 and slots 3..9 keep their initial state
    Case("gapped_labels", _runs(200, [(2, 3, 40), (3, 40, 60)]), num_segments=10),
    # ~ -20 nats per token, documents restarting inside chunks with non-zero initial states
    Case("steep_decay_restarts", _runs(200, [(1, 0, 20), (2, 20, 21), (3, 21, 70), (4, 70, 200)]),
         num_segments=10, steep=True),
    Case("t1", None, seq_len=1),
    Case("t63_k_gt_v", None, seq_len=63, key_dim=24, value_dim=8),
    Case("t65_l2norm_softplus", None, seq_len=65, l2norm=True, gate="softplus"),
    Case("t130_bounded", _runs(130, [(1, 0, 130)]), num_segments=1, gate="bounded"),
    Case("b3_shared_map_no_h0", _runs(100, [(1, 0, 30), (3, 30, 31), (2, 31, 90)]), batch=3,
         num_segments=3, gate="softplus", l2norm=True, with_h0=False),
    Case("b3_packed_bounded_bf16", PACKED, batch=3, num_segments=10, gate="bounded", l2norm=True,
         dtype="bfloat16"),
    # the model's own options: Kimi's softplus gate (no bound), L2 norm, bf16
    Case("b3_packed_softplus_bf16", PACKED, batch=3, num_segments=10, gate="softplus", l2norm=True,
         dtype="bfloat16"),
    # gentle and steep chunks in one call (the TPU kernel picks each chunk's diagonal-block path from
    # its rows at run time): chunk 1 steep throughout, chunk 3 gentle but for one row
    Case("steep_and_gentle_chunks", _runs(256, [(1, 0, 100), (2, 100, 256)]), num_segments=2,
         steep_rows=((64, 128), (200, 201))),
]


def make_inputs(case: Case, seed: int = 0):
  """Random inputs for a case (beta includes exact 0 and 1). Returns a dict of NumPy arrays."""
  rng = np.random.default_rng(seed)
  t = case.seq_len if case.seg is None else case.seg.shape[0]
  b, h, kd, vd = case.batch, case.heads, case.key_dim, case.value_dim
  q = rng.standard_normal((b, t, h, kd))
  k = rng.standard_normal((b, t, h, kd))
  if not case.l2norm:
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
  v = rng.standard_normal((b, t, h, vd))
  if case.gate is None:
    g = -rng.uniform(0.0, 0.6, (b, t, h, kd))
    if case.steep:
      g = -rng.uniform(18.0, 22.0, (b, t, h, kd))
    for start, stop in case.steep_rows:
      g[:, start:stop] = -rng.uniform(18.0, 22.0, (b, stop - start, h, kd))
  else:
    g = rng.standard_normal((b, t, h, kd)) * 2.0
  beta = rng.uniform(0.0, 1.0, (b, t, h))
  beta.reshape(-1)[::7] = 0.0
  beta.reshape(-1)[3::7] = 1.0
  n = case.num_segments or 1
  h0 = rng.standard_normal((b, n, h, kd, vd)) * 0.5 if case.with_h0 else np.zeros((b, n, h, kd, vd))
  out = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)
  if case.gate is not None:
    out["a_log"] = rng.uniform(-1.0, 0.5, (h,))
    out["dt_bias"] = rng.standard_normal((h * kd,)) * 0.5
  dt = np.float32 if case.dtype == "float32" else None
  import ml_dtypes  # noqa: PLC0415  (jax's dependency; gives NumPy bfloat16)
  cast = np.float32 if dt else ml_dtypes.bfloat16
  for name in ("q", "k", "v", "beta"):
    out[name] = out[name].astype(cast)
  out["g"] = out["g"].astype(np.float32)
  out["h0"] = out["h0"].astype(np.float32)
  return out
