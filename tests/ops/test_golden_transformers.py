"""Our KDA ops against goldens from HF transformers' Kimi-Linear reference (tests/fixtures/ops/*.npz).

The goldens were written by tests/fixtures/make_fixtures.py from transformers'
`chunk_kimi_delta_attention` (stored as `o`, `final_state`: the model's prefill path) and
`recurrent_kimi_delta_attention` (`o_recurrent`, `final_state_recurrent`: its decode path), already
converted to our batch-first layout with key-major states. The packed case is assembled from one
reference call per document (the torch references take no cu_seqlens).

Tolerance: 1e-5 max abs in float32, with unit-norm q, k (as the model feeds them). The fixtures
record each reference's own float32 error against a float64 recurrence (`err_*`, at most ~1e-6, on
the steep-decay chunked case); `test_reference_error_is_far_below_tolerance` keeps that margin
honest, and `test_goldens_match_float64_recurrence` re-derives every golden with a NumPy float64
recurrence written here, so a corrupted or mis-converted fixture cannot pass silently.

Ops under test: `kda_reference` and `kda_decode_step` on every case; `kda_chunked` on the packed
case in the default run and on the rest under `-m slow` (each shape is a multi-second compile).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops import kda_decode_step, kda_reference
from kda_plugin.ops.chunked import kda_chunked
from tests.oracles import kda_recurrence_f64

OPS_DIR = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "ops"
CASES = sorted(p.stem for p in OPS_DIR.glob("*.npz"))
ATOL = 1e-5
GOLDENS = [("o", "final_state"), ("o_recurrent", "final_state_recurrent")]


def load(case: str) -> dict[str, np.ndarray]:
  with np.load(OPS_DIR / f"{case}.npz", allow_pickle=False) as z:
    return {key: z[key] for key in z.files}


def recurrence_f64(d):
  """Float64 KDA recurrence (decay, predict, write, read) with segment slots; the independent oracle."""
  seg = d.get("segment_ids")
  packed = seg is not None
  h0 = d.get("initial_state")
  if h0 is not None and not packed:
    h0 = h0[:, None]
  o, states = kda_recurrence_f64(d["q"], d["k"], d["v"], d["g"], d["beta"], seg, h0, float(d["scale"]))
  return o, (states if packed else states[:, 0])


def op_kwargs(d):
  kw = {"output_final_state": True}
  if "initial_state" in d:
    kw["initial_state"] = jnp.asarray(d["initial_state"])
  if "segment_ids" in d:
    kw["segment_ids"] = jnp.asarray(d["segment_ids"])
  return kw


def assert_close(name, got, want, atol=ATOL):
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape, f"{name}: shape {got.shape} != golden {want.shape}"
  err = float(np.max(np.abs(got - want)))
  assert err <= atol, f"{name}: max abs error {err:.3e} > {atol:.0e}"


def check_against_goldens(label, d, o, state):
  for o_key, s_key in GOLDENS:
    assert_close(f"{label} output vs transformers {o_key}", o, d[o_key])
    assert_close(f"{label} final state vs transformers {s_key}", state, d[s_key])
  if "segment_ids" in d:
    pad = np.asarray(d["segment_ids"]) == 0
    assert np.all(np.asarray(o)[pad] == 0.0), f"{label}: padding outputs must be exactly 0"


def test_fixture_set_is_complete():
  # A missing file would silently shrink the parametrisation below.
  assert {"t1_decode_h0", "t63_k16_v32", "t130_k32_v16_h0", "t130_steep_h0", "packed_t108_n3"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_goldens_match_float64_recurrence(case):
  d = load(case)
  o64, s64 = recurrence_f64(d)
  check_against_goldens(f"{case} float64 oracle", d, o64, s64)


@pytest.mark.parametrize("case", CASES)
def test_reference_error_is_far_below_tolerance(case):
  d = load(case)
  errs = {k: float(v) for k, v in d.items() if k.startswith("err_")}
  assert errs, "fixture lacks the recorded reference errors"
  worst = max(errs, key=errs.get)
  assert errs[worst] < ATOL / 5, f"{worst} = {errs[worst]:.2e}: the reference itself is too close to ATOL"


@pytest.mark.parametrize("case", CASES)
def test_kda_reference_matches_transformers(case):
  d = load(case)
  q, k, v, g, beta = (jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta"))
  o, state = kda_reference(q, k, v, g, beta, **op_kwargs(d))
  assert o.dtype == jnp.float32 and state.dtype == jnp.float32
  check_against_goldens("kda_reference", d, o, state)


# Every case is a new shape and costs kda_chunked a fresh compile (about 9 s of CPU each, measured
# with /usr/bin/time on this 2-core machine), so only the richest case runs in `make test`: packing
# with per-slot initial states, an absent label, padding and a document crossing the 64-token chunk
# edge. The others (steep decay, K != V, T = 63 and T = 1) run with `make test-slow`; in the default
# run they still reach kda_chunked transitively (kda_reference == transformers here, and
# kda_chunked == kda_reference in tests of kda_chunked).
CHUNKED_FAST = {"packed_t108_n3"}


@pytest.mark.parametrize("case", [c if c in CHUNKED_FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_kda_chunked_matches_transformers(case):
  d = load(case)
  q, k, v, g, beta = (jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta"))
  o, state = kda_chunked(q, k, v, g, beta, **op_kwargs(d))
  check_against_goldens("kda_chunked", d, o, state)


@jax.jit
def _decode_scan(state, q, k, v, g, beta):
  """Runs kda_decode_step over time (inputs time-major [T, B, ...])."""
  def step(s, xs):
    o, s = kda_decode_step(*xs, s)
    return s, o
  state, o = jax.lax.scan(step, state, (q, k, v, g, beta))
  return jnp.swapaxes(o, 0, 1), state


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("packed")])
def test_kda_decode_step_matches_transformers(case):
  # transformers decodes one token at a time with the recurrent form: the decode step must agree
  # with it (and with the chunked prefill) token after token.
  d = load(case)
  b, _, h, kd = d["q"].shape
  state = d.get("initial_state", np.zeros((b, h, kd, d["v"].shape[-1]), np.float32))
  tm = lambda x: jnp.swapaxes(jnp.asarray(x), 0, 1)
  o, state = _decode_scan(jnp.asarray(state), *(tm(d[n]) for n in ("q", "k", "v", "g", "beta")))
  check_against_goldens("kda_decode_step", d, o, state)
