"""Gates, l2norm, the short convolution and the decode step against NumPy float64 formulas written here."""

import numpy as np
import pytest

from kda_plugin.ops.decode import kda_decode_step
from kda_plugin.ops.gates import kda_gate_bounded, kda_gate_softplus, l2norm
from kda_plugin.ops.reference import kda_reference
from kda_plugin.ops.short_conv import short_conv, short_conv_step

RNG = np.random.default_rng(0)
H, K = 3, 5


def _np_softplus(x):
  return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0.0)


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_softplus_gate():
  raw = RNG.normal(scale=3.0, size=(2, 7, H, K)).astype(np.float32)
  a_log = RNG.normal(size=(H,)).astype(np.float32)
  dt_bias = RNG.normal(size=(H * K,)).astype(np.float32)
  want = -np.exp(a_log.astype(np.float64))[:, None] * _np_softplus(raw + dt_bias.reshape(H, K))
  got = kda_gate_softplus(raw, a_log, dt_bias)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got) <= 0)


def test_bounded_gate():
  raw = RNG.normal(scale=3.0, size=(2, 7, H, K)).astype(np.float32)
  a_log = RNG.normal(size=(H,)).astype(np.float32)
  dt_bias = RNG.normal(size=(H, K)).astype(np.float32)
  want = -3.5 * _np_sigmoid(np.exp(a_log.astype(np.float64))[:, None] * (raw + dt_bias))
  got = kda_gate_bounded(raw, a_log, dt_bias, lower_bound=-3.5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all((np.asarray(got) >= -3.5) & (np.asarray(got) <= 0))  # saturates in float32


def test_l2norm_eps_inside_sqrt():
  x = RNG.normal(size=(4, H, K)).astype(np.float32)
  x[0, 0] = 1e-4                                  # tiny vector: eps dominates
  xd = x.astype(np.float64)
  want = xd / np.sqrt(np.sum(xd * xd, axis=-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(l2norm(x), want, rtol=1e-5, atol=1e-7)


def _np_conv(x, w, seg, cache, act=True):
  """Loop oracle: y[t] = silu(sum_j w[j] x[t-(W-1)+j]) over t's own segment, else that slot's cache."""
  b_, t_, d = x.shape
  width = w.shape[0]
  y = np.zeros((b_, t_, d))
  for b in range(b_):
    for t in range(t_):
      lab = seg[b, t]
      if lab == 0:
        continue
      acc = np.zeros(d)
      for j in range(width):
        src = t - (width - 1) + j
        start = t
        while start > 0 and seg[b, start - 1] == lab:
          start -= 1
        if src >= start:
          acc += w[j] * x[b, src]
        else:
          acc += w[j] * cache[b, lab - 1, (width - 1) - (start - src)]
      y[b, t] = acc / (1.0 + np.exp(-acc)) if act else acc
  return y


def _np_conv_cache(x, seg, cache):
  """Each slot's last W-1 inputs after the sequence (its old cache shifted in front of its tokens)."""
  out = cache.astype(np.float64).copy()
  for b in range(x.shape[0]):
    for n in range(cache.shape[1]):
      toks = x[b, seg[b] == n + 1]
      if len(toks):
        out[b, n] = np.concatenate([cache[b, n], toks])[-cache.shape[2]:]
  return out


@pytest.mark.parametrize("width", [4, 2, 5])
def test_short_conv_segments_and_caches(width):
  b, t, d, n = 2, 17, 6, 4
  x = RNG.normal(size=(b, t, d)).astype(np.float32)
  w = RNG.normal(size=(width, d)).astype(np.float32)
  seg = np.array([[1] * 2 + [2] * 1 + [3] * 9 + [0] * 2 + [4] * 3,
                  [0] * 3 + [2] * 8 + [1] * 6], np.int32)
  cache = RNG.normal(size=(b, n, width - 1, d)).astype(np.float32)
  y, new_cache = short_conv(x, w, segment_ids=seg, cache=cache, output_final_cache=True)
  np.testing.assert_allclose(y, _np_conv(x, w, seg, cache), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_cache, _np_conv_cache(x, seg, cache), rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(y)[seg == 0] == 0)


def _np_conv_grads(x, w, seg, ct):
  """Float64 gradients of sum(ct * short_conv(x, w, segment_ids=seg)) with zero windows, by the chain
  rule written out: g = ct * silu'(pre) on labelled tokens; each in-run tap t <- src gives
  d x[src] += w[j] g[t] and d w[j] += g[t] x[src]."""
  b_, t_, d = x.shape
  width = w.shape[0]
  dx, dw = np.zeros((b_, t_, d)), np.zeros((width, d))
  for b in range(b_):
    for t in range(t_):
      lab = seg[b, t]
      if lab == 0:
        continue
      start = t
      while start > 0 and seg[b, start - 1] == lab:
        start -= 1
      taps = [(j, t - (width - 1) + j) for j in range(width) if t - (width - 1) + j >= start]
      pre = sum(w[j] * x[b, src] for j, src in taps)
      sig = 1.0 / (1.0 + np.exp(-pre))
      g = ct[b, t] * sig * (1.0 + pre * (1.0 - sig))
      for j, src in taps:
        dx[b, src] += w[j] * g
        dw[j] += g * x[b, src]
  return dx, dw


@pytest.mark.parametrize("width", [4, 2])
def test_short_conv_gradients_without_a_cache(width):
  """Training's path (segment_ids, no cache): its custom backward against the float64 chain rule,
  with runs shorter than the window, padding and a run crossing nothing."""
  import jax

  b, t, d = 2, 17, 6
  x = RNG.normal(size=(b, t, d)).astype(np.float32)
  w = RNG.normal(size=(width, d)).astype(np.float32)
  ct = RNG.normal(size=(b, t, d)).astype(np.float32)
  seg = np.array([[1] * 2 + [2] * 1 + [3] * 9 + [0] * 2 + [4] * 3,
                  [0] * 3 + [2] * 8 + [1] * 6], np.int32)
  loss = lambda x, w: (short_conv(x, w, segment_ids=seg, max_num_segments=4)[0] * ct).sum()
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  want_dx, want_dw = _np_conv_grads(x.astype(np.float64), w.astype(np.float64), seg, ct.astype(np.float64))
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(dx)[seg == 0] == 0)


def test_short_conv_prefill_then_steps_equals_full():
  b, t, d, width, split = 2, 11, 5, 4, 6
  x = RNG.normal(size=(b, t, d)).astype(np.float32)
  w = RNG.normal(size=(width, d)).astype(np.float32)
  full, _ = short_conv(x, w)
  y0, cache = short_conv(x[:, :split], w, output_final_cache=True)
  ys = [np.asarray(y0)]
  for i in range(split, t):
    yi, cache = short_conv_step(x[:, i], w, cache)
    ys.append(np.asarray(yi)[:, None])
  np.testing.assert_allclose(np.concatenate(ys, axis=1), full, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(full, _np_conv(x, w, np.ones((b, t), np.int32),
                                            np.zeros((b, 1, width - 1, d))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_time_axis", [False, True])
def test_decode_steps_equal_reference(with_time_axis):
  b, t, h, kd, vd = 2, 9, 2, 4, 3
  q = RNG.normal(size=(b, t, h, kd)).astype(np.float32)
  k = RNG.normal(size=(b, t, h, kd)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = RNG.normal(size=(b, t, h, vd)).astype(np.float32)
  g = -RNG.uniform(size=(b, t, h, kd)).astype(np.float32)
  beta = RNG.uniform(size=(b, t, h)).astype(np.float32)
  state = RNG.normal(size=(b, h, kd, vd)).astype(np.float32)
  want_o, want_s = kda_reference(q, k, v, g, beta, initial_state=state, output_final_state=True)
  outs = []
  for i in range(t):
    sl = slice(i, i + 1) if with_time_axis else i
    o, state = kda_decode_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state)
    outs.append(np.asarray(o) if with_time_axis else np.asarray(o)[:, None])
  np.testing.assert_allclose(np.concatenate(outs, axis=1), want_o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state, want_s, rtol=1e-5, atol=1e-6)
