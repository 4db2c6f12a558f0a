"""Pallas GPU (Triton) kernels of packed-sequence KDA inference: chunk-parallel prep, then the state pass.

Two kernels, the structure of fla's chunk_kda with the segment masks of
docs/packing.md section 'Segment-native chunk algorithm':
1. `_chunk_kernel`, grid (chunks, B*H), all independent: gate activation, q/k L2 norm, the cumulative
   gate G (restarted at each document's first row in the chunk, cut rows skipped:
   `_gpu_chunk_math.document_gates`), the segment-masked Akk/Aqk (any number of documents per
   chunk), the UT inverse M = (I + Diag(beta) Akk)^-1 and, per row r of document s, the
   state-independent operands of the recurrence: `w = M (beta k exp(G))`, `u = M (beta v)`,
   `qg = q~ exp(G)`, `kg = k exp(G_e - G)`, `dec = exp(G)` (read at e, s's last row in the chunk) and
   `aqk`; each factor is 0 where a cut (a row whose decay underflows) lies in its span.
2. `_state_kernel`, grid (V blocks, B*H, documents): documents never share state, so each document is
   its own chain. A program walks the chunks its document touches, carrying that document's float32
   state `S [K, BV]` in registers: `vnew = u - w S` on its rows, `o = qg S + aqk vnew` (stored on its rows
   only), `S <- Diag(dec_e) S + kg^T vnew`. No per-chunk state goes to HBM; the final state is written
   once. Rows of padding stay at the zeros the output buffer starts from.
Matmuls use the tensor cores (`_gpu_chunk_math.Dots`): TF32 for bfloat16 inputs, TF32x3 for float32.
The intermediates are stored in the input dtype (bf16 halves the traffic between the kernels), `dec`
in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kda_plugin.ops import _gpu_chunk_math as gm

C = gm.CHUNK
MAX_KV = 128  # K and V at most this: a [K, BV] float32 state and the [C, K] tiles stay in registers
MAX_SEGMENTS = 65535  # grid dimension limit of CUDA (y and z axes)
# Tile sizes by matmul passes (1: bf16 inputs, TF32; 3: float32 inputs, TF32x3), the largest that
# compile without register spills for K = V = 128 on sm_90a (tests/aot/test_gpu_kernel_compile.py).
BLOCK_V = {1: 32, 3: 16}  # V columns of the state per program of the state pass
KEY_BLOCK = {1: 32, 3: 16}  # key channels per block of the chunk kernel
STATE_KEY_BLOCK = {1: 128, 3: 64}  # key channels per row block of the state in the state pass


def check_limits(key_dim: int, value_dim: int, num_segments: int) -> None:
  """Raises ValueError naming the limit when the GPU kernels cannot run a shape (before any lowering).

  Limits: K and V at most `MAX_KV` (128), num_segments at most `MAX_SEGMENTS` (a CUDA grid axis).
  """
  if max(key_dim, value_dim) > MAX_KV:
    raise ValueError(f"implementation 'pallas_gpu' supports K and V up to {MAX_KV} (the state tile lives in "
                     f"registers); got K={key_dim}, V={value_dim}")
  if num_segments > MAX_SEGMENTS:
    raise ValueError(f"implementation 'pallas_gpu' supports at most {MAX_SEGMENTS} segments per row (one grid "
                     f"axis of the state pass); got max_num_segments={num_segments}")


def workspace_bytes(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int, dtype) -> int:
  """HBM bytes the GPU path allocates besides its inputs and outputs: the chunk kernel's outputs
  (w, qg, kg `[B*H, Tp, Kp]`, u `[B*H, Tp, Vp]`, aqk `[B*H, Tp, 64]` in the input dtype, dec float32
  `[B*H, Tp, Kp]`), the zero-filled padded output buffer, and the per-row tables (boundary flags,
  per-chunk counts, document chunk ranges: int32, small). Padded copies of the inputs are not included.
  """
  kp, vp = padded_dims(key_dim, value_dim)
  tp = -(-seq_len // C) * C
  item = jnp.dtype(dtype).itemsize
  bh = batch * heads
  prep = bh * tp * ((3 * kp + vp + C) * item + 4 * kp)
  return int(prep + batch * tp * heads * vp * item + batch * tp * 4 * 4)


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def padded_dims(key_dim: int, value_dim: int) -> tuple[int, int]:
  """(Kp, Vp): powers of two >= 16, as Triton's tiles and tensor-core dots need."""
  return max(16, _next_pow2(key_dim)), max(16, _next_pow2(value_dim))


def _chunk_kernel(count_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, segr_ref, flag_ref, *refs, gate,
                  lower_bound, use_l2norm, scale, key_dim, key_block, dots):
  if gate:
    aexp_ref, dtb_ref, *refs = refs
  w_ref, u_ref, qg_ref, kg_ref, aqk_ref, dec_ref = refs
  store = w_ref.dtype
  seg = seg_ref[...]
  valid = seg != 0
  flags = flag_ref[...]
  starts, ends = flags & 1, jnp.right_shift(flags, 1)
  n_starts, n_ends = count_ref[0], count_ref[1]
  kp = q_ref.shape[-1]
  kb = min(key_block, kp)
  q_scale = k_scale = 1.0
  if use_l2norm:  # the row norms need every channel; everything else is per channel
    q_scale = gm.l2norm_scale(q_ref[...].astype(jnp.float32))
    k_scale = gm.l2norm_scale(k_ref[...].astype(jnp.float32))
  q_scale = jnp.where(valid, q_scale * scale, 0.0)
  k_scale = jnp.where(valid, k_scale, 0.0)
  r, col = gm.iota((C, C), 0), gm.iota((C, C), 1)
  same = (seg == segr_ref[...]) & valid
  beta = jnp.where(valid, beta_ref[...].astype(jnp.float32), 0.0)

  def channel_block(jb):
    """Gate sums (`gm.DocumentGates`) and normalised keys of key channels jb * KB .. (jb + 1) * KB."""
    j0 = pl.multiple_of(jb * kb, kb)
    ch = pl.ds(j0, kb)
    g = g_ref[:, ch].astype(jnp.float32)
    if gate:
      g = gm.activate_gate(g, aexp_ref[:, ch], dtb_ref[:, ch], lower_bound)
      g = jnp.where(gm.iota(g.shape, 1) + j0 < key_dim, g, 0.0)
    dg = gm.document_gates(jnp.where(valid, g, 0.0), starts, n_starts)
    return ch, dg, k_ref[:, ch].astype(jnp.float32) * k_scale

  # Two passes over the key channels, in blocks of KEY_BLOCK, each recomputing the (cheap,
  # elementwise) gates: the scores with the per-row operands; then, after the inverse, W. Scores are
  # sums over channels and everything else is per channel, so, with loops (not unrolled), few tiles
  # are live at once: that is what keeps the kernel within 255 registers without spills.
  nb = kp // kb

  def scores_body(jb, acc):
    ch, dg, k = channel_block(jb)
    q = q_ref[:, ch].astype(jnp.float32) * q_scale
    # Decay from the document's first row in the chunk to r (0 past a cut); at the document's last
    # row in the chunk, this is the decay of its state across the chunk that the state pass reads.
    dec = jnp.exp(jnp.where(valid & (dg.entered != 0), dg.G, gm.NEG_INF))
    dec_ref[:, ch] = dec
    qg_ref[:, ch] = (q * dec).astype(store)
    ge, run_e = gm.at_document_ends(dg.G, ends, n_ends), gm.at_document_ends(dg.run, ends, n_ends)
    kg_ref[:, ch] = (k * jnp.exp(jnp.where(valid & (run_e == dg.run), ge - dg.G, gm.NEG_INF))).astype(store)
    a_kk, a_qk = gm.chunk_scores(q, k, dg.G, dots, lower_bound=lower_bound if gate else None, run=dg.run)
    return acc[0] + a_kk, acc[1] + a_qk

  zero = jnp.zeros((C, C), jnp.float32)
  akk, aqk = lax.fori_loop(0, nb, scores_body, (zero, zero))
  aqk_ref[...] = jnp.where(same & (r >= col), aqk, 0.0).astype(store)
  akk = beta * jnp.where(same & (r > col), akk, 0.0)
  m_inv = gm.unit_lower_inverse(akk, dots) if dots.passes == 1 else gm.unit_lower_inverse_rows(akk)
  vp = v_ref.shape[-1]

  @pl.loop(0, vp // min(kb, vp))
  def _(jb):
    ch = pl.ds(pl.multiple_of(jb * min(kb, vp), min(kb, vp)), min(kb, vp))
    u_ref[:, ch] = dots(m_inv, beta * v_ref[:, ch].astype(jnp.float32)).astype(store)

  @pl.loop(0, nb)
  def _(jb):
    ch, dg, k = channel_block(jb)
    dec = jnp.exp(jnp.where(valid & (dg.entered != 0), dg.G, gm.NEG_INF))
    w_ref[:, ch] = dots(m_inv, beta * k * dec).astype(store)


def _state_kernel(range_ref, seg_ref, w_ref, u_ref, qg_ref, kg_ref, aqk_ref, dec_ref, *refs, has_h0,
                  want_final, key_block, dots):
  if has_h0:
    h0_ref, *refs = refs
  _, o_ref, *refs = refs  # the zero-filled output buffer aliased to o
  fs_ref = refs[0] if want_final else None
  label = pl.program_id(2) + 1
  kp, bv = w_ref.shape[-1], u_ref.shape[-1]
  kb = min(key_block, kp)
  # The state as row blocks of KB key channels (a tuple carried by the loop): every matmul with it
  # splits the same way, so each one's operands are [C, KB] tiles.
  blocks = [slice(j, j + kb) for j in range(0, kp, kb)]
  if has_h0:
    state = tuple(h0_ref[blk, :] for blk in blocks)
  else:
    state = tuple(jnp.zeros((kb, bv), jnp.float32) for _ in blocks)

  def step(c, state):
    rows = pl.ds(pl.multiple_of(c * C, C), C)
    mine = seg_ref[rows, :] == label
    last = jnp.where(c == range_ref[1], range_ref[2], C - 1)  # the document's last row in chunk c
    pred = out = jnp.zeros((C, bv), jnp.float32)
    for blk, s in zip(blocks, state):
      pred = pred + dots(w_ref[rows, blk], s)
      out = out + dots(qg_ref[rows, blk], s)
    vnew = jnp.where(mine, u_ref[rows, :].astype(jnp.float32) - pred, 0.0)
    out = out + dots(aqk_ref[rows, :], vnew)
    plgpu.store(o_ref.at[rows, :], out.astype(o_ref.dtype), mask=jnp.broadcast_to(mine, out.shape))
    end_row = pl.ds(c * C + last, 1)
    return tuple(dec_ref[end_row, blk].reshape(kb, 1) * s + dots.tn(kg_ref[rows, blk], vnew)
                 for blk, s in zip(blocks, state))

  state = lax.fori_loop(range_ref[0], range_ref[1] + 1, step, state)
  if want_final:
    for blk, s in zip(blocks, state):
      fs_ref[blk, :] = s


def _boundary_flags(seg):
  """int32 `[B, Tp]`: bit 0 = a document's first row at a chunk row > 0, bit 1 = a document's last
  row inside its chunk (last row of the chunk included)."""
  b, tp = seg.shape
  pos = jnp.arange(tp) % C
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
  nxt = jnp.pad(seg[:, 1:], ((0, 0), (0, 1)))
  live = seg != 0
  start = live & (pos != 0) & (seg != prev)
  end = live & ((pos == C - 1) | (seg != nxt))
  return (start.astype(jnp.int32) | (end.astype(jnp.int32) << 1))


def _boundary_counts(flags):
  """int32 `[B, NC, 2]`: per chunk, how many documents start inside it and how many end in it."""
  b, tp = flags.shape
  f = flags.reshape(b, tp // C, C)
  return jnp.stack([jnp.sum(f & 1, axis=-1), jnp.sum(jnp.right_shift(f, 1), axis=-1)], axis=-1)


def _chunk_ranges(seg, num_segments):
  """int32 `[B, N, 4]`: first chunk, last chunk, and last row inside the last chunk of label n + 1 of
  each row ((0, -1, 0) when absent), then a 0 (Triton blocks are powers of two)."""
  b, tp = seg.shape
  n1 = num_segments + 1
  ids = (seg + jnp.arange(b, dtype=jnp.int32)[:, None] * n1).reshape(-1)
  chunk = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32) // C, (b, tp)).reshape(-1)
  pos = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp)).reshape(-1)
  first = jax.ops.segment_min(chunk, ids, num_segments=b * n1).reshape(b, n1)[:, 1:]
  last_pos = jax.ops.segment_max(pos, ids, num_segments=b * n1).reshape(b, n1)[:, 1:]
  last = last_pos // C
  absent = last_pos < 0
  zero = jnp.zeros_like(first)
  return jnp.stack([jnp.where(absent, 0, first), jnp.where(absent, -1, last),
                    jnp.where(absent, 0, last_pos % C), zero], axis=-1)


def _compiler(num_warps, num_stages=1):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def chunk_prep(q2, k2, v2, g2, beta2, seg, a_exp, dt_bias, *, num_heads, key_dim, scale, lower_bound,
               use_l2norm, dots, interpret, key_block, num_warps=8):
  """Kernel 1 on padded operands. q2, k2, g2 `[B, Tp, H*Kp]`; v2 `[B, Tp, H*Vp]`; beta2 `[B, Tp, H]`;
  seg int32 `[B, Tp]`; a_exp, dt_bias float32 `[H, 1, Kp]` or None.

  Returns (w, u, qg, kg, aqk, dec): `[B*H, Tp, Kp | Vp | C]` in q's dtype, dec float32 `[B*H, Tp, Kp]`.
  """
  b, tp, hk = q2.shape
  h = num_heads
  kp, vp = hk // h, v2.shape[2] // h
  nc = tp // C
  gate = a_exp is not None
  flags = _boundary_flags(seg)
  tile = lambda d: pl.BlockSpec((None, C, d), lambda c, bh: (bh // h, c, bh % h))
  col = pl.BlockSpec((None, C, 1), lambda c, bh: (bh // h, c, 0))
  in_specs = [pl.BlockSpec((None, None, 2), lambda c, bh: (bh // h, c, 0)), tile(kp), tile(kp), tile(vp), tile(kp), pl.BlockSpec((None, C, 1), lambda c, bh: (bh // h, c, bh % h)),
              col, pl.BlockSpec((None, 1, C), lambda c, bh: (bh // h, 0, c)), col]
  operands = [_boundary_counts(flags), q2, k2, v2, g2, beta2, seg[:, :, None], seg[:, None, :],
              flags[:, :, None]]
  if gate:
    spec = pl.BlockSpec((None, 1, kp), lambda c, bh: (bh % h, 0, 0))
    in_specs += [spec, spec]
    operands += [a_exp, dt_bias]
  out_tile = lambda d: pl.BlockSpec((None, C, d), lambda c, bh: (bh, c, 0))
  st = q2.dtype
  out_shape = [jax.ShapeDtypeStruct((b * h, tp, d), dt) for d, dt in
               ((kp, st), (vp, st), (kp, st), (kp, st), (C, st), (kp, jnp.float32))]
  out_specs = [out_tile(s.shape[2]) for s in out_shape]
  kernel = functools.partial(_chunk_kernel, gate=gate, lower_bound=lower_bound, use_l2norm=use_l2norm,
                             scale=float(scale), key_dim=key_dim, key_block=key_block, dots=dots)
  return pl.pallas_call(kernel, out_shape=out_shape, grid=(nc, b * h), in_specs=in_specs,
                        out_specs=out_specs, interpret=bool(interpret), name="kda_gpu_chunk_prep",
                        compiler_params=_compiler(num_warps))(*operands)


def state_pass(prep, seg, h0, *, num_heads, num_segments, value_dim_padded, want_final, dots,
               out_dtype, interpret, block_v, key_block, num_warps=4):
  """Kernel 2: the per-document recurrence over chunks. prep = `chunk_prep`'s outputs; seg int32
  `[B, Tp]`; h0 float32 `[B, N, H, Kp, Vp]` or None.

  Returns (o `[B, Tp, H*Vp]` in out_dtype, final `[B, N, H, Kp, Vp]` float32 or None).
  """
  w, u, qg, kg, aqk, dec = prep
  bh, tp, kp = w.shape
  h, n, vp = num_heads, num_segments, value_dim_padded
  b = bh // h
  bv = min(block_v, vp)
  nv = vp // bv
  full = lambda d: pl.BlockSpec((None, tp, d), lambda vb, i, s: (i, 0, 0))
  in_specs = [pl.BlockSpec((None, None, 4), lambda vb, i, s: (i // h, s, 0)),
              pl.BlockSpec((None, tp, 1), lambda vb, i, s: (i // h, 0, 0)),
              full(kp), pl.BlockSpec((None, tp, bv), lambda vb, i, s: (i, 0, vb)), full(kp), full(kp),
              full(C), full(kp)]
  operands = [_chunk_ranges(seg, n), seg[:, :, None], w, u, qg, kg, aqk, dec]
  state_spec = pl.BlockSpec((None, None, None, kp, bv), lambda vb, i, s: (i // h, s, i % h, 0, vb))
  if h0 is not None:
    in_specs.append(state_spec)
    operands.append(h0)
  o_spec = pl.BlockSpec((None, tp, bv), lambda vb, i, s: (i // h, 0, (i % h) * nv + vb))
  in_specs.append(o_spec)
  operands.append(jnp.zeros((b, tp, h * vp), out_dtype))
  out_shape = [jax.ShapeDtypeStruct((b, tp, h * vp), out_dtype)]
  out_specs = [o_spec]
  if want_final:
    out_shape.append(jax.ShapeDtypeStruct((b, n, h, kp, vp), jnp.float32))
    out_specs.append(state_spec)
  kernel = functools.partial(_state_kernel, has_h0=h0 is not None, want_final=want_final,
                             key_block=key_block, dots=dots)
  outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(nv, bh, n), in_specs=in_specs,
                        out_specs=out_specs, input_output_aliases={len(operands) - 1: 0},
                        interpret=bool(interpret), name="kda_gpu_state_pass",
                        compiler_params=_compiler(num_warps, 2))(*operands)
  return outs[0], (outs[1] if want_final else None)


def dots_for(dtype, interpret) -> gm.Dots:
  """TF32 for bfloat16 inputs, TF32x3 for float32 (see `_gpu_chunk_math.Dots`)."""
  return gm.Dots(passes=1 if jnp.dtype(dtype) == jnp.bfloat16 else 3, emulate=bool(interpret))


def kda_inference_gpu(q, k, v, g, beta, seg, h0, gate, *, num_segments, scale, lower_bound, use_l2norm,
                      want_final, interpret, dots=None):
  """The `pallas_gpu` implementation of `kda_inference` on validated operands (called under its jit).

  The seam between `kda_plugin.ops.inference_gpu` (the dispatch table's GPU entry: limits, head
  split, memory model) and the GPU kernels: padding to the kernels' tiles and the per-document chunk
  ranges are this module's business.

  Args:
    q, k, g: `[B, T, H, K]`; v: `[B, T, H, V]`; beta: `[B, T, H]` (public layouts; q, k, v, beta
      float32 or bfloat16, g float32).
    seg: int32 `[B, T]` segment ids, or None (one document per row).
    h0: float32 `[B, N, H, K, V]` per-slot initial states, or None (zeros).
    gate: `(a_log [H], dt_bias [H, K])` float32 for the in-kernel gate, or None (g is the log decay).
    num_segments: N (static); scale: float; lower_bound: float or None (bounded gate family).
    want_final: also return the final states. interpret: run both kernels in Pallas' interpreter.
    dots: override of the matmul precision (`_gpu_chunk_math.Dots`), for the precision tests.

  Returns:
    (o `[B, T, H, V]` in q's dtype (0 on padding), final float32 `[B, N, H, K, V]` or None; an absent
    label keeps its initial state).

  Boundaries and steep gates: the cumulative gate restarts at every document's first row, inside a
  chunk too, so a document's results do not depend on the decay of the documents before it; a row
  whose log decay is <= -104 (exp underflows to 0 in float32) is a cut: the decay of every span over
  it is exactly 0, as in the token recurrence, and adds nothing to the gate sums. The exponents left
  are differences of G, the sum of one document's non-cut gates since its first row in the chunk, so
  each is rounded relative to |G| (about |G| * 2^-24): negligible for mild gates, and at most
  63 * 104 * 2^-24 (~4e-4) when rows decaying by nearly 104 nats each, without underflowing, precede
  mild ones in one chunk.

  Raises:
    ValueError: a shape beyond `check_limits`.
  """
  b, t, h, kd = q.shape
  vd = v.shape[3]
  check_limits(kd, vd, num_segments)
  kp, vp = padded_dims(kd, vd)
  tp = -(-t // C) * C
  if dots is None:
    dots = dots_for(q.dtype, interpret)
  if seg is None:
    seg = jnp.ones((b, t), jnp.int32)
  seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, tp - t)))
  pad4 = lambda x, last: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, last - x.shape[3])))
  q2 = pad4(q, kp).reshape(b, tp, h * kp)
  k2 = pad4(k, kp).reshape(b, tp, h * kp)
  g2 = pad4(g, kp).reshape(b, tp, h * kp)
  v2 = pad4(v, vp).reshape(b, tp, h * vp)
  beta2 = jnp.pad(beta, ((0, 0), (0, tp - t), (0, 0)))
  a_exp = dt_row = None
  if gate is not None:
    a_log, dt_bias = gate
    a_exp = jnp.broadcast_to(jnp.exp(a_log)[:, None, None], (h, 1, kp))
    dt_row = jnp.pad(dt_bias, ((0, 0), (0, kp - kd)))[:, None, :]
  prep = chunk_prep(q2, k2, v2, g2, beta2, seg, a_exp, dt_row, num_heads=h, key_dim=kd, scale=scale,
                    lower_bound=lower_bound, use_l2norm=use_l2norm, dots=dots, interpret=interpret,
                    key_block=KEY_BLOCK[dots.passes])
  if h0 is not None:
    h0 = jnp.pad(h0.astype(jnp.float32), ((0, 0),) * 3 + ((0, kp - kd), (0, vp - vd)))
  o2, final = state_pass(prep, seg, h0, num_heads=h, num_segments=num_segments, value_dim_padded=vp,
                         want_final=want_final, dots=dots, out_dtype=q.dtype, interpret=interpret,
                         block_v=BLOCK_V[dots.passes], key_block=STATE_KEY_BLOCK[dots.passes])
  o = o2.reshape(b, tp, h, vp)[:, :t, :, :vd]
  if final is not None:
    final = final[..., :kd, :vd]
  return o, final
