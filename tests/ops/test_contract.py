"""The shared input contract: every sequence op rejects the same bad inputs, naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops.chunked import kda_chunked
from kda_plugin.ops.inference_xla import kda_inference_xla
from kda_plugin.ops.reference import kda_reference

OPS = [kda_reference, kda_chunked, kda_inference_xla]
B, T, H, K, V = 1, 6, 2, 4, 3


def _args(**over):
  rng = np.random.default_rng(0)
  a = dict(q=rng.normal(size=(B, T, H, K)), k=rng.normal(size=(B, T, H, K)),
           v=rng.normal(size=(B, T, H, V)), g=-rng.uniform(size=(B, T, H, K)),
           beta=rng.uniform(size=(B, T, H)))
  a = {n: x.astype(np.float32) for n, x in a.items()}
  a.update(over)
  return a


def _call(op, a, **kw):
  return op(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,shape", [("k", (B, T, H, K + 1)), ("g", (B, T + 1, H, K)),
                                        ("v", (B, T, H + 1, V)), ("beta", (B, T, H, 1))])
def test_mismatched_shapes(op, name, shape):
  with pytest.raises(ValueError, match=name):
    _call(op, _args(**{name: np.zeros(shape, np.float32)}))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["q", "v", "beta"])
def test_integer_inputs(op, name):
  a = _args()
  with pytest.raises(TypeError, match=name):
    _call(op, _args(**{name: a[name].astype(np.int32)}))


@pytest.mark.parametrize("op", OPS)
def test_beta_outside_unit_interval(op):
  a = _args()
  a["beta"][0, 2, 1] = 1.5
  with pytest.raises(ValueError, match="beta must lie in"):
    _call(op, a)


@pytest.mark.parametrize("op", [kda_reference, kda_chunked])
def test_positive_g(op):
  a = _args()
  a["g"][0, 1, 0, 0] = 0.3
  with pytest.raises(ValueError, match="g is the log-space decay"):
    _call(op, a)


@pytest.mark.parametrize("lb", [-6.0, 0.0, 0.5])
def test_lower_bound_out_of_range(lb):
  with pytest.raises(ValueError, match="lower_bound"):
    _call(kda_inference_xla, _args(), a_log=np.zeros(H, np.float32), lower_bound=lb)


def test_gate_parameters_need_a_log():
  with pytest.raises(ValueError, match="a_log"):
    _call(kda_inference_xla, _args(), lower_bound=-5.0)


@pytest.mark.parametrize("op", OPS)
def test_negative_labels(op):
  seg = np.array([[1, 1, 1, -1, -1, 2]], np.int32)
  with pytest.raises(ValueError, match="segment_ids must be >= 0"):
    _call(op, _args(), segment_ids=seg, max_num_segments=2)


@pytest.mark.parametrize("op", OPS)
def test_label_above_max_num_segments(op):
  seg = np.array([[1, 1, 2, 2, 3, 3]], np.int32)
  with pytest.raises(ValueError, match="exceeds max_num_segments"):
    _call(op, _args(), segment_ids=seg, max_num_segments=2)


@pytest.mark.parametrize("op", OPS)
def test_initial_state_slot_count(op):
  seg = np.array([[1, 1, 2, 2, 0, 0]], np.int32)
  h0 = np.zeros((B, 3, H, K, V), np.float32)
  with pytest.raises(ValueError, match="initial_state"):
    _call(op, _args(), segment_ids=seg, initial_state=h0, max_num_segments=2)


@pytest.mark.parametrize("op", OPS)
def test_max_num_segments_missing_under_jit(op):
  a = _args()
  seg = jnp.ones((B, T), jnp.int32)
  with pytest.raises(ValueError, match="max_num_segments"):
    jax.jit(lambda s: _call(op, a, segment_ids=s))(seg)
