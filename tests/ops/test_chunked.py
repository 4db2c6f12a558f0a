"""`kda_chunked` and `kda_inference_xla` against `kda_reference` on the hard packing cases.

Most cases share one shape (B=2, T=130 = two full chunks + 2 rows, H=2, K=16 != V=8, N=6 slots) so
that the jitted ops compile once per configuration; the token recurrence is the oracle.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_plugin.ops.chunked import chunk_gates, kda_chunked, score_level
from kda_plugin.ops.gates import kda_gate_bounded, kda_gate_softplus, l2norm
from kda_plugin.ops.inference_xla import kda_inference_xla
from kda_plugin.ops.reference import kda_reference
from tests.oracles import kda_recurrence_f64

B, T, H, K, V, N = 2, 130, 2, 16, 8, 6
TOL = 1e-5


def _row(*runs):
  """A segment row from (label, length) runs, padded with 0 to T."""
  row = np.concatenate([np.full(n, lab, np.int32) for lab, n in runs])
  return np.pad(row, (0, T - row.size))


LAYOUTS = {
    # a boundary inside a chunk; two long documents
    "boundary_inside_chunk": [_row((1, 40), (2, 90)), _row((3, 100), (5, 30))],
    # three or more documents in one chunk, runs of length 1, trailing padding
    "many_docs_one_chunk": [_row((1, 5), (2, 1), (3, 1), (4, 3), (5, 1), (6, 119)),
                            _row((1, 64), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1))],
    # documents ending exactly on a chunk edge
    "edge_aligned": [_row((1, 64), (2, 64), (3, 2)), _row((4, 128))],
    # a chunk of padding only (rows 64..127), and a leading all-padding chunk
    "padding_chunk": [_row((1, 10), (0, 118), (2, 2)), _row((0, 64), (3, 66))],
    # labels with gaps (only 2 and 3 present): slots 1, 4, 5, 6 stay empty
    "gapped_labels": [_row((2, 70), (3, 60)), _row((0, 5), (3, 50), (0, 10), (2, 65))],
}


def _inputs(seed, t=T, *, steep=False, unit_qk=True):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, t, H, K))
  k = rng.normal(size=(B, t, H, K))
  if unit_qk:
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(B, t, H, V))
  # about -20 nats per token when steep, else a mild decay
  g = -rng.uniform(15.0, 25.0, size=(B, t, H, K)) if steep else -rng.uniform(0.02, 1.0, (B, t, H, K))
  beta = rng.uniform(0.0, 1.0, size=(B, t, H))
  h0 = 0.5 * rng.normal(size=(B, N, H, K, V))
  f32 = lambda x: np.asarray(x, np.float32)
  return f32(q), f32(k), f32(v), f32(g), f32(beta), f32(h0)


def _seg(layout):
  return np.stack(LAYOUTS[layout])


def _max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _check_against_reference(fn, q, k, v, g, beta, seg, h0, **kw):
  o, final = fn(q, k, v, g, beta, segment_ids=seg, initial_state=h0, output_final_state=True,
                max_num_segments=N, **kw)
  ro, rf = kda_reference(q, k, v, g, beta, segment_ids=seg, initial_state=h0,
                         output_final_state=True, max_num_segments=N)
  assert _max_diff(o, ro) <= TOL
  assert _max_diff(final, rf) <= TOL
  o = np.asarray(o)
  assert np.all(o[seg == 0] == 0), "padding outputs must be exactly 0"
  init = np.zeros((B, N, H, K, V), np.float32) if h0 is None else h0
  for b in range(B):
    for n in range(N):
      if not np.any(seg[b] == n + 1):
        np.testing.assert_array_equal(np.asarray(final)[b, n], init[b, n])
  return o, final


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunked_matches_reference(layout, with_h0):
  q, k, v, g, beta, h0 = _inputs(1)
  _check_against_reference(kda_chunked, q, k, v, g, beta, _seg(layout), h0 if with_h0 else None)


@pytest.mark.parametrize("t", [1, 63, 65])  # T = 130 runs in every packed case
def test_unpacked_lengths(t):
  q, k, v, g, beta, h0 = _inputs(2, t)
  o, final = kda_chunked(q, k, v, g, beta, initial_state=h0[:, 0], output_final_state=True)
  ro, rf = kda_reference(q, k, v, g, beta, initial_state=h0[:, 0], output_final_state=True)
  assert o.shape == (B, t, H, V) and final.shape == (B, H, K, V)
  assert _max_diff(o, ro) <= TOL and _max_diff(final, rf) <= TOL


def test_beta_exactly_zero_and_one():
  q, k, v, g, beta, h0 = _inputs(3)
  pick = np.random.default_rng(3).integers(0, 3, size=beta.shape)
  beta = np.where(pick == 0, 0.0, np.where(pick == 1, 1.0, beta)).astype(np.float32)
  _check_against_reference(kda_chunked, q, k, v, g, beta, _seg("boundary_inside_chunk"), h0)


def _loss(fn, q, k, v, g, beta, h0, seg, wo, wf):
  o, final = fn(q, k, v, g, beta, segment_ids=seg, initial_state=h0, output_final_state=True,
                max_num_segments=N)
  return jnp.sum(o * wo) + jnp.sum(final * wf)


_GRAD_CHUNKED = jax.jit(jax.grad(lambda *a: _loss(kda_chunked, *a), argnums=(0, 1, 2, 3, 4, 5)))
_GRAD_REFERENCE = jax.jit(jax.grad(lambda *a: _loss(kda_reference, *a), argnums=(0, 1, 2, 3, 4, 5)))


def _weights(seed):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, T, H, V)).astype(np.float32),
          rng.normal(size=(B, N, H, K, V)).astype(np.float32))


# slow (about 35 s of CPU): the bounded-gate and gradient cases in make test cover the usual range.
@pytest.mark.slow
def test_steep_decay_outputs_and_gradients_finite():
  q, k, v, g, beta, h0 = _inputs(4, steep=True)
  seg = _seg("many_docs_one_chunk")
  _check_against_reference(kda_chunked, q, k, v, g, beta, seg, h0)
  grads = _GRAD_CHUNKED(q, k, v, g, beta, h0, seg, *_weights(4))
  for name, gr in zip("q k v g beta initial_state".split(), grads):
    assert np.all(np.isfinite(np.asarray(gr))), f"non-finite gradient for {name}"


def test_steep_gate_gradient_of_the_gate_matches_reference_entry_by_entry():
  # -15 to -25 nats a token: the true dg is ~1e-8 (the state forgets within a token) while the other
  # gradients are O(1). Aqk's diagonal, formed by the factored paths as exp(x) exp(-x), once left
  # ~1e-8 of rounding in dg (19 % of max |dg| where a document ends in a short last chunk); it is
  # now q.k exactly (chunked._exact_diagonal)
  q, k, v, _, beta, h0 = _inputs(12)
  g = _inputs(12, steep=True)[3]
  seg = _seg("boundary_inside_chunk")
  got = np.asarray(_GRAD_CHUNKED(q, k, v, g, beta, h0, seg, *_weights(12))[3], np.float64)
  want = np.asarray(_GRAD_REFERENCE(q, k, v, g, beta, h0, seg, *_weights(12))[3], np.float64)
  assert np.max(np.abs(want)) < 1e-5   # the regime: dg is tiny
  assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_gradients_match_reference():
  q, k, v, g, beta, h0 = _inputs(5)
  seg = _seg("boundary_inside_chunk")
  got = _GRAD_CHUNKED(q, k, v, g, beta, h0, seg, *_weights(5))
  want = _GRAD_REFERENCE(q, k, v, g, beta, h0, seg, *_weights(5))
  for name, a, b in zip("q k v g beta initial_state".split(), got, want):
    scale = max(1.0, float(np.max(np.abs(b))))
    assert _max_diff(a, b) <= 2e-5 * scale, f"gradient of {name} differs"


def test_gradients_match_reference_at_the_factorisation_limit():
  # Every full chunk decays by 87.5-87.8 nats per channel, just inside FACTOR_LIMIT (88): the
  # one-factorisation score path with factors near exp(+-44). Its derivative must stay finite too:
  # exp(-x) taken as 1/exp(x) and differentiated as a reciprocal squares exp(-44) into a flushed
  # subnormal, 1/0 = inf, and NaN gradients (found by a 200-step tools.train run).
  q, k, v, g, beta, h0 = _inputs(7)
  g = -np.random.default_rng(7).uniform(1.368, 1.3715, size=g.shape).astype(np.float32)
  seg = _seg("boundary_inside_chunk")
  got = _GRAD_CHUNKED(q, k, v, g, beta, h0, seg, *_weights(7))
  want = _GRAD_REFERENCE(q, k, v, g, beta, h0, seg, *_weights(7))
  for name, a, b in zip("q k v g beta initial_state".split(), got, want):
    assert np.all(np.isfinite(np.asarray(a))), f"non-finite gradient for {name}"
    scale = max(1.0, float(np.max(np.abs(b))))
    assert _max_diff(a, b) <= 2e-5 * scale, f"gradient of {name} differs"


def _between_limits_gate(seed):
  # -2.0 to -2.5 nats per token: a full chunk decays by ~144 nats (beyond FACTOR_LIMIT, so no one
  # factorisation per chunk), a 16-row sub-block by ~36 (within SUB_FACTOR_LIMIT): score level 1, the factored
  # sub-blocks, which a model's gates at initialisation mostly take (chunked.score_level)
  return -np.random.default_rng(seed).uniform(2.0, 2.5, size=(B, T, H, K)).astype(np.float32)


@pytest.mark.parametrize("layout", ["boundary_inside_chunk", "edge_aligned"])
def test_score_level_follows_the_decay(layout):
  seg = jnp.asarray(_seg(layout)[:, :128].reshape(B, 2, 64).transpose(1, 0, 2))   # [NC, B, C]
  chunks = lambda g: jnp.moveaxis(jnp.asarray(g[:, :128]).reshape(B, 2, 64, H, K), 1, 0)
  level = lambda g, c: int(score_level(chunk_gates(chunks(g)[c], seg[c])))
  mild, steep = _inputs(9)[3], _inputs(9, steep=True)[3]
  middle = _between_limits_gate(9)
  for c in range(2):
    assert [level(mild, c), level(middle, c), level(steep, c)] == [0, 1, 2]
  # the cumulative gate restarts at each document's first row: chunk 1 of boundary_inside_chunk's
  # second row holds the last 36 rows of one document and the first 28 of the next; at ~2.25 nats a
  # row neither decays by 88 nats, so that chunk of that row alone is level 0
  if layout == "boundary_inside_chunk":
    one = lambda g: int(score_level(chunk_gates(chunks(g)[1][1:], seg[1][1:])))
    assert one(middle) == 0


def test_outputs_and_gradients_match_reference_between_the_factorisation_limits():
  q, k, v, _, beta, h0 = _inputs(10)
  g = _between_limits_gate(10)
  seg = _seg("many_docs_one_chunk")
  _check_against_reference(kda_chunked, q, k, v, g, beta, seg, h0)
  got = _GRAD_CHUNKED(q, k, v, g, beta, h0, seg, *_weights(10))
  want = _GRAD_REFERENCE(q, k, v, g, beta, h0, seg, *_weights(10))
  for name, a, b in zip("q k v g beta initial_state".split(), got, want):
    scale = max(1.0, float(np.max(np.abs(b))))
    assert _max_diff(a, b) <= 2e-5 * scale, f"gradient of {name} differs"


def _rel_rms(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.mark.parametrize("fn", [kda_chunked, kda_inference_xla], ids=["chunked", "inference_xla"])
def test_bfloat16(fn):
  *xs, h0 = _inputs(6)
  q, k, v, g, beta = (jnp.asarray(x, jnp.bfloat16) for x in xs)
  seg = _seg("many_docs_one_chunk")
  o, final = fn(q, k, v, g, beta, segment_ids=seg, initial_state=h0, output_final_state=True,
                max_num_segments=N)
  ro, rf = kda_reference(q, k, v, g, beta, segment_ids=seg, initial_state=h0,
                         output_final_state=True, max_num_segments=N)
  assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  assert _rel_rms(o, ro) <= 5e-3 and _rel_rms(final, rf) <= 5e-3
  assert np.all(np.asarray(o, np.float32)[seg == 0] == 0)


@pytest.mark.parametrize("layout", ["many_docs_one_chunk", "gapped_labels"])
def test_inference_xla_activated_gate(layout):
  q, k, v, g, beta, h0 = _inputs(7)
  _check_against_reference(kda_inference_xla, q, k, v, g, beta, _seg(layout), h0)


@pytest.mark.parametrize("layout", ["many_docs_one_chunk", "edge_aligned"])
def test_inference_xla_chunk_pair_with_different_paths(layout):
  # kda_inference_xla builds two chunks per scan step: here the first chunk of each pair decays
  # ~20 nats per token (sub-block score path) and the second mildly (one factorisation), and the
  # layouts put a document start inside one chunk of a pair but not the other.
  q, k, v, g, beta, h0 = _inputs(8)
  steep = _inputs(8, steep=True)[3]
  rows = (np.arange(T) // 64) % 2 == 0
  g = np.where(rows[None, :, None, None], steep, g).astype(np.float32)
  _check_against_reference(kda_inference_xla, q, k, v, g, beta, _seg(layout), h0)


@pytest.mark.parametrize("family", ["softplus", "bounded"])
def test_inference_xla_in_kernel_gate_and_l2norm(family):
  q, k, v, _, beta, h0 = _inputs(8, unit_qk=False)
  rng = np.random.default_rng(8)
  raw = rng.normal(size=(B, T, H, K)).astype(np.float32)
  a_log = rng.normal(scale=0.5, size=(H,)).astype(np.float32)
  dt_bias = rng.normal(size=(H * K,)).astype(np.float32)
  lb = -5.0 if family == "bounded" else None
  seg = _seg("boundary_inside_chunk")
  o, final = kda_inference_xla(q, k, v, raw, beta, segment_ids=seg, initial_state=h0,
                               output_final_state=True, max_num_segments=N, a_log=a_log,
                               dt_bias=dt_bias, lower_bound=lb, use_qk_l2norm=True)
  g = (kda_gate_bounded(raw, a_log, dt_bias, lower_bound=lb) if lb is not None
       else kda_gate_softplus(raw, a_log, dt_bias))
  ro, rf = kda_reference(l2norm(q), l2norm(k), v, g, beta, segment_ids=seg, initial_state=h0,
                         output_final_state=True, max_num_segments=N)
  assert _max_diff(o, ro) <= TOL and _max_diff(final, rf) <= TOL


@st.composite
def _packings(draw):
  rows = []
  for _ in range(B):
    labels = draw(st.permutations(list(range(1, N + 1))))
    runs, used = [], 0
    for lab in labels:
      if used >= T:
        break
      if draw(st.booleans()):
        pad = draw(st.integers(0, 5))
        runs.append((0, min(pad, T - used)))
        used += runs[-1][1]
      n = min(draw(st.integers(1, 70)), T - used)
      if n > 0:
        runs.append((lab, n))
        used += n
    rows.append(_row(*runs))
  return np.stack(rows)


@settings(max_examples=4)
@given(seg=_packings())
def test_packed_equals_each_document_alone(seg):
  q, k, v, g, beta, _ = _inputs(9)
  run = lambda s: kda_chunked(q, k, v, g, beta, segment_ids=s, output_final_state=True,
                              max_num_segments=N)
  o, final = run(seg)
  for lab in np.unique(seg[seg > 0]):
    alone = np.where(seg == lab, lab, 0).astype(np.int32)
    o1, f1 = run(alone)
    mask = seg == lab
    assert _max_diff(np.asarray(o)[mask], np.asarray(o1)[mask]) <= TOL
    assert _max_diff(final[:, lab - 1], f1[:, lab - 1]) <= TOL


@pytest.mark.parametrize("split", [1, 37, 64, 129])
def test_split_and_chain_equals_unsplit(split):
  q, k, v, g, beta, h0 = _inputs(10)
  ones = np.ones((B, T), np.int32)
  run = lambda s, init, *x: kda_chunked(*x, segment_ids=s, initial_state=init,
                                        output_final_state=True, max_num_segments=N)
  o, final = run(ones, h0, q, k, v, g, beta)
  first = (np.arange(T) < split).astype(np.int32)[None].repeat(B, 0)
  _, f1 = run(first, h0, q, k, v, g, beta)
  shift = lambda x: np.concatenate([x[:, split:], np.zeros_like(x[:, :split])], axis=1)
  second = shift(ones)
  o2, f2 = run(second, f1, *(shift(x) for x in (q, k, v, g, beta)))
  assert _max_diff(np.asarray(o2)[:, :T - split], np.asarray(o)[:, split:]) <= TOL
  assert _max_diff(f2, final) <= TOL


# Rows over a slot pool larger than the row (the serving engine's mixed steps: one-token decode
# segments of most slots, a prompt chunk of one): the per-row initial-state path of kda_chunk_core
# (T <= 4 N after padding) and the prepare-every-chunk-once path (NC <= N), against the float64
# recurrence of tests/oracles.py.
POOL_CASES = {
    # 31 one-token segments, a 9-token prompt, padding; labels in slot order with gaps (slot 0 and
    # slots 40.. absent)
    "decode_row_n48_t40": (48, np.concatenate([np.arange(2, 33), np.full(9, 35)]).astype(np.int32), 64),
    # documents spanning the chunk edge and one-token runs in a 3-chunk row (kda_inference_xla pads
    # to 256 rows, kda_chunked to 192: both <= 4 N)
    "spanning_n64_t130": (64, np.concatenate([np.full(70, 5), np.arange(10, 40), np.full(28, 64),
                                              np.zeros(2)]).astype(np.int32), 0),
}


@pytest.mark.parametrize("fn", [kda_chunked, kda_inference_xla], ids=["chunked", "inference_xla"])
@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_slot_pool_rows_match_the_recurrence(case, fn):
  n, row, pad = POOL_CASES[case]
  seg = np.pad(row, (0, pad))[None]
  t = seg.shape[1]
  rng = np.random.default_rng(11)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(rng.normal(size=(1, t, H, K))), unit(rng.normal(size=(1, t, H, K)))
  v = rng.normal(size=(1, t, H, V))
  g = -rng.uniform(0.02, 1.0, (1, t, H, K))
  beta = rng.uniform(0.0, 1.0, (1, t, H))
  h0 = 0.5 * rng.normal(size=(1, n, H, K, V))
  f32 = lambda x: np.asarray(x, np.float32)
  o, final = fn(f32(q), f32(k), f32(v), f32(g), f32(beta), segment_ids=seg, initial_state=f32(h0),
                output_final_state=True, max_num_segments=n)
  ro, rf = kda_recurrence_f64(f32(q), f32(k), f32(v), f32(g), f32(beta), seg, f32(h0))
  assert _max_diff(o, ro) <= TOL and _max_diff(final, rf) <= TOL
  assert np.all(np.asarray(o)[seg == 0] == 0)
  absent = ~np.isin(np.arange(1, n + 1), seg)
  np.testing.assert_array_equal(np.asarray(final)[0, absent], f32(h0)[0, absent])
