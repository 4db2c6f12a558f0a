"""Pallas TPU (Mosaic) kernel for packed-sequence KDA inference with native segment IDs: the wrapper.

`kda_pallas_tpu` lays out the blocks, scratch and VMEM plan of one `pallas_call`; the kernel body is
`pallas_tpu_kernel`. Grid `(B, H / HG, NC / CPS)`: batch and head group are parallel, the chunk
axis is sequential ("arbitrary"); each step takes HG heads (`heads_per_step`: 8 when H allows) of
CPS consecutive 64-row chunks (`chunks_per_step`: up to 4), so the fixed cost of a grid step is paid
once per CPS chunks. The heads' work is independent and issued stage by stage across the heads
(`_chunk_math.chunk_prep_heads`), so their MXU latencies overlap. Every block index is arithmetic in
the grid position, so nothing about the packing steers a DMA: per chunk the step builds its piece
table (`_segment_schedule.build_chunk_table`'s entry format) in SMEM scratch from the label blocks,
the chunk's matrices once (cumulative gate, masked Akk / Aqk, the UT inverse, U), then loops over
the chunk's pieces (the runs of one document inside it). Each piece applies its incoming state: the
carried state in VMEM scratch when it continues the previous chunk's open document, its slot's
initial state (copied from HBM by a synchronous DMA) when one is given, none otherwise.

Per-slot final states live in HBM (`memory_space=ANY`): the output is aliased to the initial states
(zeros when none are given) and each document's final state is DMAed into its slot at the step where
the document ends, so slots that never appear keep their initial state.

Layouts (prepared by `kda_plugin.ops.inference_tpu`): q, k, g `[B, Tp, H*Kp]`, v and o `[B, Tp, H*Vp]`
(the lane-dense layout of the model's projections, K and V multiples of 128, T of 64: no copy when
already aligned); beta `[B, H, Tp2]` (Tp2 = Tp rounded up to 128; XLA keeps a `[B, T, H]` beta
with T minor, so this is a free transpose), lane-dense. The segment map never enters the kernel as
a vector: each chunk rebuilds its label column from the piece table.

Math: `_chunk_math` (docs/kda.md section 'Chunked form (WY/UT)', docs/packing.md section 'Segment-native chunk algorithm').
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops import _segment_schedule as ss
from kda_plugin.ops import pallas_tpu_kernel as tk

C = ss.CHUNK
LANE = tk.LANE
MAX_CHUNKS_PER_STEP = 4  # chunks per grid step at most (VMEM of the per-chunk scratch)
MAX_KV = 256  # K and V padded above this would overflow the VMEM plan (states are [Kp, Vp] float32)


def matmul_precision(dtype) -> cm.Dots:
  """The MXU precision of every matmul but the cumulative gate's: bf16 operands with float32
  accumulation (one MXU pass) for bfloat16 inputs, the UT inverse included (their 5e-3 relative
  tolerance holds: tests/kernels/test_inference_numerics.py); float32 at HIGHEST (six passes) for
  float32 inputs (1e-4 absolute). One exception for bfloat16 inputs: the state update and the
  state's contribution to the output are bf16x3 (`Dots.tn3` / `nn3`: the nearly-parallel-keys case
  needs them, see `_chunk_math.piece_state_update`). The cumulative gate is exact for both
  (`_chunk_math.cumsum_rows_split`): summed from one bf16 pass it would be off by ~0.1 nats over a
  chunk."""
  return cm.Dots(bf16=jnp.dtype(dtype) == jnp.bfloat16)


def heads_per_step(num_heads: int, kp: int, vp: int) -> int:
  """Heads one grid step processes (their chains are independent and issued stage by stage, so their
  MXU latencies overlap, and the step count drops by that factor): the largest of 8, 4, 2, 1 dividing
  H, 4 at most for K or V of 256 (VMEM)."""
  cap = 4 if max(kp, vp) > LANE else 8
  return next(d for d in (8, 4, 2, 1) if d <= cap and num_heads % d == 0)


def chunks_per_step(num_chunks: int) -> int:
  """64-row chunks one grid step processes: the largest of MAX_CHUNKS_PER_STEP, ..., 2, 1 dividing
  the chunk count (a grid step has a fixed cost that one chunk of 8 heads does not hide; the
  estimates per setting are in docs/performance.md)."""
  return next(d for d in (4, 2, 1) if d <= MAX_CHUNKS_PER_STEP and num_chunks % d == 0)


def kda_pallas_tpu(q2, k2, v2, g2, beta_t, seg, *, num_heads, key_dim, scale,
                   use_l2norm, a_log=None, dt_bias=None, lower_bound=None, initial_state=None,
                   num_segments=1, want_final=False, want_states=False, interpret=False):
  """Runs the Mosaic kernel on prepared operands (see the module docstring for layouts).

  Args:
    q2, k2, g2: `[B, Tp, H*Kp]`; v2: `[B, Tp, H*Vp]` (Kp, Vp multiples of 128, Tp of 64), or all
      four head-major `[B, Tp, H, D]` (read in place; `heads_layout_ok` must hold).
    beta_t: `[B, H, Tp2]` (Tp2 = Tp rounded up to 128), float32 or bfloat16.
    seg: int32 `[B or 1, Tp2]` segment labels (0 = padding, also past T; one row when every batch
      row shares the map). The kernel builds each chunk's piece table from them in SMEM.
    a_log: float32 `[H]` (read as SMEM scalars; the kernel takes exp), dt_bias: float32
      `[1, H*Kp]` (lane-dense, zero on padded lanes): the in-kernel gate, or None.
    initial_state: float32 `[B, N, H, Kp, Vp]` or None.
    want_states: also return the state entering every chunk (the training op's residual,
      `kda_plugin.ops.chunked_tpu`): the state of the document open at the chunk's first row edge,
      zeros where none is (a document that ends at a chunk's last row leaves zeros). Needs no
      initial_state.
    interpret: False, or a `pltpu.InterpretParams` to simulate the TPU on CPU.

  Returns:
    (o `[B, Tp, H*Vp]` (or `[B, Tp, H, Vp]` for head-major inputs) in q's dtype, final
    `[B, N, H, Kp, Vp]` float32 or None, states `[NC, B, H, Kp, Vp]` float32 or None).
  """
  heads_layout = q2.ndim == 4
  bsz, tp = q2.shape[:2]
  kp = q2.shape[-1] if heads_layout else q2.shape[2] // num_heads
  vp = v2.shape[-1] if heads_layout else v2.shape[2] // num_heads
  nc = tp // C
  gate = a_log is not None
  has_h0 = initial_state is not None
  if want_states and has_h0:
    raise ValueError("want_states needs initial_state=None (the training op's forward)")
  words = ss.chunk_table_words(num_segments)
  cps = chunks_per_step(nc)
  rows = C * cps  # block rows of one grid step
  seg_w = max(LANE, rows)  # labels per SMEM block (its chunks: seg_w // C)
  if seg.shape[1] % seg_w or beta_t.shape[2] != seg.shape[1]:
    raise ValueError(f"seg and beta_t need {seg_w}-aligned T, got {seg.shape} and {beta_t.shape}")
  shared = seg.shape[0] == 1  # one segment map for every row
  nblk = seg.shape[1] // seg_w
  seg = seg.reshape(-1)  # 1-D SMEM blocks of seg_w labels
  row0 = lambda b: (0 if shared else b) * nblk
  blk = lambda s: s * cps // (seg_w // C)  # the label block of grid step s

  hg = heads_per_step(num_heads, kp, vp)
  if heads_layout:
    if not heads_layout_ok(num_heads, kp, vp, q2.dtype):
      raise ValueError(f"head-major operands need H % 8 == 0 and K, V <= 128, got H={num_heads}, "
                       f"K={kp}, V={vp}")
    if hg == num_heads:  # [B, T*H, D]: strided rows
      q2, k2, v2, g2 = (x.reshape(bsz, tp * num_heads, x.shape[-1]) for x in (q2, k2, v2, g2))
      blk_k = pl.BlockSpec((None, rows * hg, kp), lambda b, h, s: (b, s, 0))
      blk_v = pl.BlockSpec((None, rows * hg, vp), lambda b, h, s: (b, s, 0))
    else:
      blk_k = pl.BlockSpec((None, rows, hg, kp), lambda b, h, s: (b, s, h, 0))
      blk_v = pl.BlockSpec((None, rows, hg, vp), lambda b, h, s: (b, s, h, 0))
  else:
    blk_k = pl.BlockSpec((None, rows, hg * kp), lambda b, h, s: (b, s, h))
    blk_v = pl.BlockSpec((None, rows, hg * vp), lambda b, h, s: (b, s, h))
  blk_o = pl.BlockSpec((None, rows, hg * vp), lambda b, h, s: (b, s, h))
  in_specs = [
      pl.BlockSpec((seg_w,), lambda b, h, s: (row0(b) + jnp.maximum(blk(s) - 1, 0),),
                   memory_space=pltpu.SMEM),
      pl.BlockSpec((seg_w,), lambda b, h, s: (row0(b) + blk(s),), memory_space=pltpu.SMEM),
      pl.BlockSpec((seg_w,), lambda b, h, s: (row0(b) + jnp.minimum(blk(s) + 1, nblk - 1),),
                   memory_space=pltpu.SMEM),
      blk_k, blk_k, blk_v, blk_k,
      pl.BlockSpec((None, num_heads, seg_w), lambda b, h, s: (b, 0, blk(s)))]
  operands = [seg, seg, seg, q2, k2, v2, g2, beta_t]
  if gate:
    in_specs += [pl.BlockSpec(memory_space=pltpu.SMEM),
                 pl.BlockSpec((1, hg * kp), lambda b, h, s: (0, h))]
    operands += [a_log, dt_bias]
  aliases = {}
  if has_h0:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(initial_state)
  elif want_final:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(jnp.zeros((bsz, num_segments, num_heads, kp, vp), jnp.float32))
  if want_final:
    aliases = {len(operands) - 1: 1}

  out_shape = [jax.ShapeDtypeStruct((bsz, tp, num_heads * vp), q2.dtype)]
  out_specs = [blk_o]
  if want_final:
    out_shape.append(jax.ShapeDtypeStruct((bsz, num_segments, num_heads, kp, vp), jnp.float32))
    out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
  if want_states:  # chunk-major, as the backward kernel reads them: grid step s writes chunks s*CPS..
    out_shape.append(jax.ShapeDtypeStruct((nc, bsz, num_heads, kp, vp), jnp.float32))
    out_specs.append(pl.BlockSpec((cps, None, hg, kp, vp), lambda b, h, s: (s, b, h, 0, 0)))

  f32 = jnp.float32
  n = cps * hg  # per-chunk scratch: chunk j's head i at j * hg + i
  scratch = [pltpu.VMEM((hg, kp, vp), f32),  # state of the open document (carried / DMAed in)
             pltpu.VMEM((n, C, kp), f32), pltpu.VMEM((n, C, kp), f32),  # G, q~
             pltpu.VMEM((n, C, kp), f32),  # k
             pltpu.VMEM((n, C, C), f32), pltpu.VMEM((n, C, C), f32),  # (I + beta Akk)^-1, Aqk
             pltpu.VMEM((n, C, vp), f32), pltpu.VMEM((n, C, vp), f32),  # U, Vnew
             pltpu.VMEM((n, C, vp), f32),  # O
             pltpu.VMEM((n, C, 1), f32),  # beta column
             pltpu.VMEM((hg, kp, vp), f32),  # a final state on its way to HBM
             pltpu.SMEM((cps * words,), jnp.int32)]  # the chunks' piece tables
  if heads_layout and hg == num_heads and jnp.dtype(q2.dtype).itemsize == 2:
    scratch += [pltpu.VMEM((rows * hg, kp), f32)] * 3 + [pltpu.VMEM((rows * hg, vp), f32)]  # q k v g
  kernel = functools.partial(
      tk.kernel, heads_per_step=hg, chunks_per_step=cps, scale=float(scale), use_l2norm=use_l2norm,
      gate=gate, lower_bound=lower_bound, has_h0=has_h0, want_final=want_final,
      want_states=want_states, key_dim=key_dim,
      out_dtype=q2.dtype, dots=matmul_precision(q2.dtype), num_chunks=nc, heads_layout=heads_layout,
      words=words)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, num_heads // hg, nc // cps), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch, input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes(kp, vp, num_heads, hg, cps, want_states)),
      interpret=interpret, name="kda_train_fwd_tpu" if want_states else "kda_inference_tpu")(*operands)
  return outs[0], (outs[1] if want_final else None), (outs[-1] if want_states else None)


def heads_layout_ok(num_heads: int, kp: int, vp: int, dtype) -> bool:
  """Whether the kernel can read `[B, T, H, D]` operands in place (`pallas_tpu_kernel._head_reader`): a step's heads
  are whole (8, 128) tiles of one token (a multiple of 8 heads per step), float32 or bfloat16."""
  return (heads_per_step(num_heads, kp, vp) % 8 == 0
          and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)))


def vmem_limit_bytes(kp: int, vp: int, num_heads: int, hg: int = 1, cps: int = 1,
                     want_states: bool = False) -> int:
  """VMEM plan for `hg` heads of `cps` chunks per step: double-buffered input/output blocks (the
  chunk-entry states' block too with `want_states`) + scratch, with 2x headroom for the kernel's
  temporaries (score blocks, exponent tiles), at least 32 MiB."""
  f4 = 4
  seg_w = max(LANE, C * cps)
  blocks = 2 * (cps * hg * (3 * C * kp + 2 * C * vp + (kp * vp if want_states else 0))
                + max(num_heads, 16) * seg_w) * f4
  scratch = (cps * hg * (3 * C * kp + 2 * C * C + 3 * C * vp + C * LANE)
             + 2 * hg * kp * vp) * f4
  return max(32 << 20, 2 * (blocks + scratch) + (8 << 20))
