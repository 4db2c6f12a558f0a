"""One chunk of one head of the training op, written to be differentiated inside a Mosaic kernel.

`chunk_head` maps the state entering a 64-row chunk and the chunk's rows to its output rows and the
state leaving it, with the same masked equations as the XLA chunk scan (`chunked.chunk_with_state`,
docs/kda.md section 'Chunked form (WY/UT)', docs/packing.md section 'Segment-native chunk
algorithm'), and `chunk_head_vjp` is its vector-Jacobian product by JAX autodiff, traced inside the
backward kernel (`chunked_tpu_bwd`). Everything is 2-D float32 values and the ops Mosaic lowers
(and their transposes): matmuls in the nn / nt / tn forms, masked reductions, selects, `exp`,
`log1p`, `logistic`, `rsqrt`; no loop is differentiated (a `fori_loop` has no reverse-mode lowering
in a kernel: the inverse's forward substitution sits inside a custom VJP).

Numerics: every exponent is a direct sum of the gates it spans (`_direct_sums`: one masked matmul
for all of them, as the XLA op's direct sums, never a difference of cumulative sums), and masked
*before* `exp` or bounded, so no factor overflows and the backward never forms `0 * inf` (the
cotangent of a masked entry meets only finite factors). Scores: the entries below the diagonal 16x16
blocks come factored at each column block's last row (factors <= 1, `_below_diag_scores`); the
diagonal blocks from one factored product when every row of the chunk decays by at most
`GENTLE_LOG_DECAY` nats (always for the bounded gate: `_diag_scores_factored`), else elementwise,
one masked exponent per entry (`_diag_scores_exact`).

Precision (`bf16`): the recomputed forward as the forward kernel's (`pallas_tpu.matmul_precision`):
float32 inputs take every product at HIGHEST; bfloat16 inputs one bf16 MXU pass with float32
accumulation, three for the products with the state (`Dots._mm3`). The cotangent products take
three passes for bfloat16 inputs (`_mm`, a custom VJP, `_cotangent_mode`: the gate's gradients are
differences of them). The gate sums are exact either way (`_masked_sums`): their rounding enters
every exponent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops._chunk_common import GENTLE_LOG_DECAY, NEG_INF, SUB

_FORMS = {"nn": ((1,), (0,)), "nt": ((1,), (1,)), "tn": ((0,), (0,))}


def _raw_product(mode, form, a, b):
  """`a @ b` ("nn"), `a @ b.T` ("nt") or `a.T @ b` ("tn") of float32 `[.., ..]` values, float32
  result: mode "f32" at HIGHEST (six bf16 MXU passes), "bf16" one pass of bf16 operands, "bf16x3"
  three (`_chunk_math.Dots._mm3`)."""
  dots = cm.Dots(bf16=mode != "f32")
  if mode == "bf16x3":
    return dots._mm3(a, b, _FORMS[form])
  return dots._mm(a, b, _FORMS[form])


def _cotangent_mode(mode):
  """The precision of a product's cotangent products: three bf16 passes for a one-pass product. The
  gate's gradients are differences of such products (dG = q dq - k dk, summed over rows and channels
  for a_log and dt_bias), which one pass leaves off by up to ~1e-1 of their largest element against
  the float32 op (3 passes: ~4e-3, as the XLA op's bf16 gradients)."""
  return "bf16x3" if mode == "bf16" else mode


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mm(mode, form, a, b):
  """`_raw_product` whose cotangent products take `_cotangent_mode(mode)` and a float32 result (JAX's
  own transpose of a bf16 product would round the cotangents of its operands to bf16)."""
  return _raw_product(mode, form, a, b)


def _mm_fwd(mode, form, a, b):
  return _raw_product(mode, form, a, b), (a, b)


def _mm_bwd(mode, form, res, ct):
  a, b = res
  mode = _cotangent_mode(mode)
  if form == "nn":    # out = a b
    return _raw_product(mode, "nt", ct, b), _raw_product(mode, "tn", a, ct)
  if form == "nt":    # out = a b^T
    return _raw_product(mode, "nn", ct, b), _raw_product(mode, "tn", ct, a)
  return _raw_product(mode, "nt", b, ct), _raw_product(mode, "nn", a, ct)   # out = a^T b


_mm.defvjp(_mm_fwd, _mm_bwd)


def _mask_product_exact(form, mask, x):
  """`mask @ x` ("nn") or `mask.T @ x` ("tn") for a 0/1 float32 mask, exact to float32 rounding of
  the sums in three bf16 MXU passes (`_chunk_math.split_bf16x3`, one accumulation)."""
  axis = 1 if form == "nn" else 0
  m = mask.astype(jnp.bfloat16)
  pieces = jnp.concatenate(cm.split_bf16x3(x), axis=0)
  return lax.dot_general(jnp.concatenate([m, m, m], axis=axis), pieces,
                         (_FORMS[form], ((), ())), precision=cm._BF16_PASS,
                         preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _masked_sums(exact_bf16, mask, x):
  """`mask @ x` for a constant 0/1 `mask [M, C]` and float32 `x [C, K]`, and its cotangent
  `mask.T @ ct`, both exact to float32 rounding: at HIGHEST, or (`exact_bf16`) in three bf16
  passes (`_mask_product_exact`)."""
  if exact_bf16:
    return _mask_product_exact("nn", mask, x)
  return _raw_product("f32", "nn", mask, x)


def _masked_sums_fwd(exact_bf16, mask, x):
  return _masked_sums(exact_bf16, mask, x), mask


def _masked_sums_bwd(exact_bf16, mask, ct):
  dx = _mask_product_exact("tn", mask, ct) if exact_bf16 else _raw_product("f32", "tn", mask, ct)
  return jnp.zeros_like(mask), dx


_masked_sums.defvjp(_masked_sums_fwd, _masked_sums_bwd)


def _gate(raw, a_exp, dt_bias, lower_bound):
  """`_chunk_common.activate_gate` with a derivative that stays finite everywhere: the bounded gate
  through `logistic` (1 / (1 + exp(-x)) would form 0 * inf in reverse mode where exp overflows)."""
  x = raw + dt_bias
  if lower_bound is None:
    return -a_exp * (jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x))))
  return lower_bound * jax.nn.sigmoid(a_exp * x)


def _direct_sums(g, seg_col, steep, bf16):
  """Every gate sum the chunk's exponents need, each a direct sum of the gates it spans (one masked
  matmul at float32 HIGHEST for all of them), never a difference of two cumulative sums: the
  rounding of an exponent is relative to the decay it spans, not to the chunk's whole decay.

  Returns a dict of `[C, K]` arrays: `G` (from the first row of r's document in the chunk to r),
  `to_end` (after r to the chunk's end, within r's document), `block` (from the first row of r's
  16-row block, within its document, to r), `after[b]` for column blocks b < C/16 - 1 (after the
  block's last row p to r, for r > p), `inside` (after r to its block's last row) and, when `steep`,
  `diag[j]` (after row j of r's block to r, for the elementwise diagonal blocks).
  """
  c = g.shape[0]
  r, z = cm.iota((c, c), 0), cm.iota((c, c), 1)
  same = (seg_col == cm.col_to_row(seg_col)) & (seg_col != 0)
  first = jnp.left_shift(jnp.right_shift(r, 4), 4)
  nb = c // SUB
  masks = {"G": z <= r, "to_end": z > r, "block": (z >= first) & (z <= r),
           "inside": (z > r) & (z <= first + SUB - 1)}
  for b in range(nb - 1):
    masks[f"after{b}"] = (z > b * SUB + SUB - 1) & (z <= r)
  if steep:
    for j in range(SUB):
      masks[f"diag{j}"] = (z > first + j) & (z <= r)
  names = list(masks)
  stacked = jnp.concatenate([(masks[n] & same).astype(jnp.float32) for n in names], axis=0)
  sums = _masked_sums(bf16, stacked, g)
  return {n: sums[i * c:(i + 1) * c] for i, n in enumerate(names)}


def _below_diag_scores(q, k, seg_col, sums, mode):
  """`(akk, aqk)` entries below the diagonal 16x16 blocks (`_chunk_math._below_diag_scores`'s one
  product), each factor's exponent a direct sum: exp(sum_{p < z <= r} g) exp(sum_{i < z <= p} g)
  with p the last row of column i's block, both masked to p's document before exp (<= 1)."""
  c, d = q.shape
  rows = cm.iota((c, d), 0)
  seg_d = jnp.broadcast_to(seg_col, (c, d))
  k_inside = k * jnp.exp(jnp.where(cm.block_row(seg_d, SUB - 1) == seg_d, sums["inside"], NEG_INF))
  k_parts, q_parts, key_parts = [], [], []
  for b in range(c // SUB - 1):
    p = b * SUB + SUB - 1
    below = jnp.exp(jnp.where((rows > p) & (seg_d == cm.row_at(seg_col, p)), sums[f"after{b}"],
                              NEG_INF))
    k_parts.append(k * below)
    q_parts.append(q * below)
    key_parts.append(jnp.where((rows >= b * SUB) & (rows <= p), k_inside, 0.0))
  lhs = jnp.concatenate([jnp.concatenate(k_parts, axis=1), jnp.concatenate(q_parts, axis=1)], axis=0)
  both = _mm(mode, "nt", jnp.concatenate(key_parts, axis=1), lhs).T
  return both[:c], both[c:]


def _diag_scores_factored(q, k, sums, mode):
  """The diagonal 16x16 blocks of `(akk, aqk)` `[C, C]` in one product: exp(D_r - D_i) =
  exp(D_r - m) exp(m - D_i), D the block-local sum (`_direct_sums`' `block`), m half the block's
  lowest D per channel: each factor at most exp(8 |GENTLE_LOG_DECAY|) = exp(64) for rows decaying by
  at most GENTLE_LOG_DECAY (the bounded gate's |lower_bound| <= 5 gives exp(40)); 0 off the blocks."""
  c, d = q.shape
  dsum = sums["block"]
  d3 = dsum.reshape(c // SUB, SUB, d)
  m = lax.stop_gradient(jnp.broadcast_to(0.5 * jnp.min(d3, axis=1, keepdims=True), d3.shape)
                        .reshape(c, d))
  row_f = jnp.exp(dsum - m)
  both = _mm(mode, "nt", k * jnp.exp(m - dsum), jnp.concatenate([k * row_f, q * row_f], axis=0)).T
  r = cm.iota((c, c), 0)
  same_block = jnp.right_shift(r, 4) == jnp.right_shift(cm.iota((c, c), 1), 4)
  return jnp.where(same_block, both[:c], 0.0), jnp.where(same_block, both[c:], 0.0)


def _diag_scores_exact(q, k, seg_col, sums):
  """The diagonal 16x16 blocks of `(akk, aqk)` `[C, C]`, elementwise: iteration j (unrolled) fills
  column SUB * (r // SUB) + j of every row r, one exponent per (row, channel) (`_direct_sums`'
  `diag[j]`), masked to rows of that column's document at or after it before `exp` (<= 0)."""
  c, d = q.shape
  rows = cm.iota((c, d), 0)
  first = jnp.left_shift(jnp.right_shift(rows, 4), 4)
  cols = cm.iota((c, c), 1)
  col_first = jnp.left_shift(jnp.right_shift(cm.iota((c, c), 0), 4), 4)
  seg_d = jnp.broadcast_to(seg_col, (c, d))
  akk = jnp.zeros((c, c), jnp.float32)
  aqk = jnp.zeros((c, c), jnp.float32)
  for j in range(SUB):
    keep = (first + j <= rows) & (cm.block_row(seg_d, j) == seg_d) & (seg_d != 0)
    e = jnp.exp(jnp.where(keep, sums[f"diag{j}"], NEG_INF)) * cm.block_row(k, j)
    hit = cols == col_first + j
    akk = jnp.where(hit, jnp.sum(e * k, axis=1, keepdims=True), akk)
    aqk = jnp.where(hit, jnp.sum(e * q, axis=1, keepdims=True), aqk)
  return akk, aqk


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unit_lower_inverse(mode, a):
  """(I + a)^-1 of a strictly lower `a [C, C]` (`_chunk_math.unit_lower_inverses`: the 16-row diagonal
  blocks by forward substitution on the VPU in float32, then two doublings with `mode`'s products),
  differentiated as an inverse: dA = -X^T dX X^T on A's support. The backward kernel runs at its
  dependency chain, so it takes four serial products here rather than the forward kernel's ten for
  bf16 (the VPU has room: ESTIMATE from the compiled kernel, docs/performance.md)."""
  return cm.unit_lower_inverses([a], cm.Dots(bf16=mode != "f32"), 4)[0]


def _inverse_fwd(mode, a):
  x = _unit_lower_inverse(mode, a)
  return x, x


def _inverse_bwd(mode, x, dx):
  c = x.shape[0]
  mode = _cotangent_mode(mode)
  da = -_raw_product(mode, "nt", _raw_product(mode, "tn", x, dx), x)
  return (jnp.where(cm.iota((c, c), 0) > cm.iota((c, c), 1), da, 0.0),)


_unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def chunk_head(s_in, q, k, v, raw_g, beta, a_exp, dt_bias, seg_col, cont_lab, keep_state, *, scale,
               use_l2norm, gate, lower_bound, key_dim, steep, bf16):
  """`(o [C, V], s_out [K, V])` of one head's chunk from the state `s_in [K, V]` entering it.

  Args:
    s_in: float32 `[K, V]`, the state of the document open at the chunk's first edge (zeros where
      none is: the kernel forward's chunk states).
    q, k, raw_g: float32 `[C, K]` (K padded to 128 lanes, zeros there); v `[C, V]`; beta `[C, 1]`.
    a_exp, dt_bias: float32 `[1, K]` rows (exp(A_log) of the head, its gate bias) when `gate`, else
      None (raw_g is then the activated log decay).
    seg_col: float32 `[C, 1]` row labels (0 = padding). cont_lab: int32 scalar, the label continued
      from the previous chunk (0 for none). keep_state: bool scalar, the carried document is open at
      the chunk's last row (`chunked.carry_schedule`).
    bf16: static; the products' precision (module docstring).
    steep: static; True for a chunk with a row steeper than the factored diagonal blocks allow
      (`is_steep`: the kernel traces both forms and branches on it).

  Returns the output rows (zeros on padding) and the state of the chunk's last document at its
  last row (`chunked.chunk_with_state`'s s_next).
  """
  c, kp = q.shape
  valid = seg_col != 0
  if gate:
    g = _gate(raw_g, a_exp, dt_bias, lower_bound)
    g = jnp.where(cm.iota(g.shape, 1) < key_dim, g, 0.0)
  else:
    g = raw_g
  if not (gate and lower_bound is not None):
    g = cm.clamp_gate(g)
  g = jnp.where(valid, g, 0.0)
  if use_l2norm:
    q, k = cm.l2norm_rows(q), cm.l2norm_rows(k)
  q = q * scale
  seg_row = cm.col_to_row(seg_col)
  same = (seg_col == seg_row) & valid
  r_i, c_i = cm.iota((c, c), 0), cm.iota((c, c), 1)
  mode, state_mode = ("bf16", "bf16x3") if bf16 else ("f32", "f32")
  sums = _direct_sums(g, seg_col, steep, bf16)
  G = sums["G"]                                                    # restarted per document
  below_kk, below_qk = _below_diag_scores(q, k, seg_col, sums, mode)
  if steep:
    dkk, dqk = _diag_scores_exact(q, k, seg_col, sums)
  else:
    dkk, dqk = _diag_scores_factored(q, k, sums, mode)
  akk = beta * jnp.where(same & (r_i > c_i), dkk + below_kk, 0.0)
  aqk = jnp.where(same & (r_i >= c_i), dqk + below_qk, 0.0)
  tinv = _unit_lower_inverse(mode, akk)
  cont = (seg_col == cont_lab) & (cont_lab > 0)
  e_in = jnp.exp(jnp.where(cont, G, NEG_INF))                      # decay since the chunk start
  r = beta * (v - _mm(state_mode, "nn", k * e_in, s_in))
  vnew = _mm(mode, "nn", tinv, r)
  o = _mm(state_mode, "nn", q * e_in, s_in) + _mm(mode, "nn", aqk, vnew)
  last_lab = cm.row_at(seg_col, c - 1)
  last = (seg_col == last_lab) & valid
  k_end = k * jnp.exp(jnp.where(last, sums["to_end"], NEG_INF))
  dec = jnp.where(keep_state, cm.row_to_col(jnp.exp(cm.row_at(G, c - 1))), 0.0)  # [K, 1]
  s_out = dec * s_in + _mm(state_mode, "tn", k_end, vnew)
  return jnp.where(valid, o, 0.0), s_out


def chunk_head_vjp(s_in, q, k, v, raw_g, beta, a_exp, dt_bias, do, ds_out, seg_col, cont_lab,
                   keep_state, **kw):
  """Cotangents of `chunk_head`'s differentiable inputs from those of its outputs: `(ds_in, dq, dk,
  dv, draw_g, dbeta, da_exp, ddt_bias)` (the last two None without the gate)."""
  if kw["gate"]:
    f = lambda *xs: chunk_head(*xs, seg_col, cont_lab, keep_state, **kw)
    _, vjp = jax.vjp(f, s_in, q, k, v, raw_g, beta, a_exp, dt_bias)
    return vjp((do, ds_out))
  f = lambda *xs: chunk_head(*xs, None, None, seg_col, cont_lab, keep_state, **kw)
  _, vjp = jax.vjp(f, s_in, q, k, v, raw_g, beta)
  return vjp((do, ds_out)) + (None, None)


def is_steep(raw_g, a_exp, dt_bias, seg_col, *, gate, lower_bound, key_dim):
  """Whether a valid row of the chunk decays by more than `GENTLE_LOG_DECAY` nats in some channel
  (the factored diagonal blocks' limit, as the forward kernel decides), a bool scalar; always False
  for the bounded gate (its static bound is checked in `_chunk_common.factored_diagonal`)."""
  if gate and lower_bound is not None:
    return jnp.bool_(False)
  g = _gate(raw_g, a_exp, dt_bias, lower_bound) if gate else raw_g
  if gate:
    g = jnp.where(cm.iota(g.shape, 1) < key_dim, g, 0.0)
  return jnp.min(jnp.where(seg_col != 0, g, 0.0)) < GENTLE_LOG_DECAY
