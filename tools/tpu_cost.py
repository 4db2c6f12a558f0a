"""ESTIMATED TPU time of a KDA forward, from the compiled kernel (no TPU needed, none used).

    .venv-tpu-aot/bin/python -m tools.tpu_cost chip=tpu7x shape=seed impl=ours,tokamax_mosaic output_json=OUT
    .venv-tpu-aot/bin/python -m tools.tpu_cost chip=v5e,v6e,tpu7x shape=seed,tokamax_packed
    .venv-tpu-aot/bin/python -m tools.tpu_cost calibrate=1 calibration_out=tools/tpu_cost_calibration.json
    .venv-tpu-aot/bin/python -m tools.tpu_cost calibrate=v5e calibration_out=tools/tpu_cost_calibration_v5e.json

Every figure this tool prints is an ESTIMATE of device time made from what the TPU compiler (libtpu,
ahead of time on this CPU host, for the chip's topology) emitted. It runs in `.venv-tpu-aot`.

How. Each (chip, shape, implementation) compiles in its own child process with
`LIBTPU_INIT_ARGS=--xla_mosaic_dump_to=DIR` and `XLA_FLAGS=--xla_dump_to=DIR`. For each Mosaic
kernel the program launches (`tools.tpu_llo`, reading the post-finalize-llo pass; several
pallas_calls are matched to their custom calls by the kernel name inside the serialized body) we
count per grid step: MXU LHS vreg pushes `P_lhs` (a packed bf16 vreg counts twice: 16 rows), weight
vreg pushes `P_w`, result pops `P_pop`, VPU, EUP, XLU, vector load and store ops, the serial
dependency chain `C_chain`, and the HBM<->VMEM bytes `B_step` of the pipelined blocks (a block
whose index map ignores the innermost grid index counts once per sweep). The wrapper's XLA ops
(`tools.tpu_hlo`) take XLA's own `estimated_cycles`; ops with none take 2 x result bytes / HBM BW.
With f = peak / (n_mxu * 2 * C^2) (the MXU beat the published peak implies; see `Chip.clock_hz`):

    c_lhs   = 8 * 128 / C                     beats per 32-bit LHS vreg push (published peak rate)
    t_issue = max(P_lhs*c_lhs/n_mxu, P_w*c_w/n_mxu, P_pop/n_mxu, VPU/n_valu, EUP, XLU/n_xlu, vld, vst)
    t_step  = max(max(t_issue, C_chain) / f, B_step / HBM_BW) + s_step
    T       = sum_kernels (steps * t_step + s_op) + sum_xla_ops (cycles / f  or  2*bytes / HBM_BW) + n_xla * s_op

`C_chain` follows SSA dependencies through one step: ops take 1 beat after their operands (0 for
bitcasts), weight staging overlaps the LHS stream, a latch waits for the stream before it, a pop
waits `L` after the last push. Published chip facts (per TensorCore: jax exposes one device per
TensorCore): v5e 197 TFLOP/s bf16, 819 GB/s HBM, 4 MXUs of 128x128, 1.5 GHz (Google Cloud v5e page;
jax's Pallas chip table); v6e 918 TFLOP/s, 1640 GB/s, 2 MXUs of 256x256, 2 XLUs (Google Cloud v6e
page); TPU7x 2307 TFLOP/s and 7.37 TB/s per chip of two TensorCores, so 1153 TFLOP/s and 3.69 TB/s
per device, 2 MXUs of 256 columns (Google Cloud TPU7x page, jax's chip table). The implied beat is
1.50 GHz on v5e (its published clock) but 3.50 GHz (v6e) and 4.40 GHz (TPU7x): no silicon clock,
so read it as the model's time unit there, in which XLA's cycle estimates are converted too.
NOT published, so ASSUMED: `n_valu`=4 VALU slots; 1 EUP, 1 load, 1 store slot; `c_w`=0.5 (a subr +
latch pair per beat); `L`=2*C beats (systolic fill and drain; tokamax's chains barely depend on it,
so the calibration cannot pin it). FITTED per calibration (below): `s_step` (per grid
step) and `s_op` (per launched op). Google publishes no per-unit latencies.

Ignored: overlap between XLA ops and kernels and between kernels; DMA issue latency and HBM
contention; the LLO scheduler's real VLIW packing, spills and MXU assignment after this pass (every
push has mxu_id 0 here, so pushes are taken as spread evenly over the MXUs); both `scf.if` branches
are counted; an `scf.for`'s iterations are taken as serial in `C_chain` (trips x body chain) and
it starts when everything it reads is ready; loops with non-constant trip counts count once (reported); while loops inside XLA ops
count their bytes once; the second TensorCore; clock throttling; v6e is not calibrated (its
estimates use TPU7x's fitted overheads).

Calibrations (every figure stays an ESTIMATE; records name theirs):
- TPU7x (and v6e): tokamax 0.0.17's `mosaic` KDA forward against its four published TPU v7x
  timings, fitted on three with one held out (`calibrate=1`; tools/tpu_cost_calibration.json).
- v5e: ours against the device times measured on a real TPU v5e at the nine prefill cases of
  tools.bench.kernel_device_time (docs/measurements/tpu_v5e_kernel_5e1bb78.json), fitted on six
  with three held out (`calibrate=v5e`; tools/tpu_cost_calibration_v5e.json; docs/performance.md
  "Cost model: v5e calibration" has the per-case errors).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from model.errors import UsageError
from tools import tpu_hlo, tpu_llo
from tools.atomic_file import atomic_writer
from tools.cli import parse_key_values

CALIBRATION_PATH = pathlib.Path(__file__).with_name("tpu_cost_calibration.json")
V5E_CALIBRATION_PATH = pathlib.Path(__file__).with_name("tpu_cost_calibration_v5e.json")
V5E_MEASUREMENTS_PATH = pathlib.Path(__file__).resolve().parents[1] / "docs/measurements/tpu_v5e_kernel_5e1bb78.json"


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-TensorCore facts of one TPU generation (published; see the module docstring)."""
  name: str
  topology: str
  bf16_flops: float      # FLOP/s per TensorCore
  hbm_bytes_per_s: float
  num_mxus: int
  mxu_columns: int
  n_valu: int = 4        # VLIW vector-ALU slots: assumed (not published)
  n_xlu: int = 1

  @property
  def clock_hz(self) -> float:
    """The model's cycle: the MXU beat the published peak implies, peak / (n_mxu * 2 * C^2).

    1.50 GHz on v5e (its published clock); 3.50 GHz on v6e and 4.40 GHz on TPU7x, above any
    silicon clock: there the published peak implies more than one MXU row per cycle, and the
    model counts in these beats (XLA's estimated_cycles too) -- an assumption the calibration tests.
    """
    return self.bf16_flops / (self.num_mxus * 2 * self.mxu_columns ** 2)


CHIPS = {
    "v5e": Chip("v5e", "v5e:1x1", 197e12, 819e9, 4, 128),
    "v6e": Chip("v6e", "v6e:1x1", 918e12, 1640e9, 2, 256, n_xlu=2),
    "tpu7x": Chip("tpu7x", "tpu7x:2x2x1", 2307e12 / 2, 7.37e12 / 2, 2, 256, n_xlu=2),
}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One KDA forward problem (both implementations get the same inputs and options)."""
  name: str
  batch: int
  seq_len: int
  heads: int
  key_dim: int
  value_dim: int
  segments: int | None   # None: fixed length; 2: split at T/2-17; n > 2: n balanced segments
  output_final_state: bool
  head_first_output: bool  # tokamax's output moved to [B,T,H,V] inside the jit (as the seed timed it)
  traced_segments: bool    # segment ids a jit argument (the seed's benchmark) or a constant (tokamax's spec)
  note: str
  dtype: str = "bfloat16"  # q, k, v, g, beta
  lane_dense: bool = False  # ours only: q, k, v, g as [B, T, H*K] with num_heads=H (else [B, T, H, K])
  doc_lengths: tuple | None = None  # explicit document lengths, shared by every row ([T] segment ids)


SHAPES = {
    "seed": Shape("seed", 1, 8192, 8, 128, 128, 2, True, True, True,
                  "the seed's benchmark: B=1 T=8192 H=8 K=V=128 bf16, two documents split at T/2-17, "
                  "bounded gate and q/k L2 norm in the kernel, final states"),
    "seed_t512": Shape("seed_t512", 1, 512, 8, 128, 128, 2, True, True, True, "as seed, T=512"),
    "tokamax_fixed": Shape("tokamax_fixed", 1, 8192, 32, 128, 128, None, False, False, False,
                           "tokamax PR 1103: B=1 T=8192 H=32 K=V=128 bf16, bounded gate, fixed length"),
    "tokamax_packed": Shape("tokamax_packed", 1, 8192, 32, 128, 128, 25, False, False, False,
                            "tokamax PR 1103: as tokamax_fixed with 25 balanced packed segments"),
}


def split_lengths(t: int, n: int, seed: int = 0) -> tuple:
  """n document lengths summing to t, not 64-aligned (seeded): tools.bench.kernel_device_time._split."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False))
  return tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [t]])))


# The prefill cases timed on a real TPU v5e (tools.bench.kernel_device_time PREFILL, same names; the
# seed's options: bounded in-kernel gate, q/k L2 norm, final states; segment ids a [T] constant).
# name: (B, T, H, dtype, lane_dense, document lengths)
_V5E_CASES = {
    "seed_bf16": (1, 8192, 8, "bfloat16", True, (4079, 4113)),
    "seed_bf16_heads": (1, 8192, 8, "bfloat16", False, (4079, 4113)),
    "seed_f32": (1, 8192, 8, "float32", True, (4079, 4113)),
    "seed_f32_heads": (1, 8192, 8, "float32", False, (4079, 4113)),
    "t8192_h32_25docs": (1, 8192, 32, "bfloat16", True, split_lengths(8192, 25)),
    "t8192_h24_8x1024": (1, 8192, 24, "bfloat16", True, (1024,) * 8),
    "t4096_h24_64x64": (1, 4096, 24, "bfloat16", True, (64,) * 64),
    "one_8_token_doc_h24": (1, 8, 24, "bfloat16", True, (8,)),
    "b16_t2048_h8_4docs": (16, 2048, 8, "bfloat16", True, (500, 530, 490, 528)),
}
for _n, (_b, _t, _h, _dt, _ld, _lens) in _V5E_CASES.items():
  SHAPES[_n] = Shape(_n, _b, _t, _h, 128, 128, len(_lens), True, False, False,
                     f"v5e-measured case (tools.bench.kernel_device_time): B={_b} T={_t} H={_h} {_dt} "
                     f"{'lane-dense' if _ld else '[B,T,H,K]'}, {len(_lens)} documents",
                     dtype=_dt, lane_dense=_ld, doc_lengths=_lens)
IMPLS = ("ours", "tokamax_mosaic")


# ----------------------------------------------------------------------------- the cost model

# Constants that are not published. ASSUMED ones are fixed by reasoning stated here; FITTED ones come
# from tools/tpu_cost_calibration.json (see `calibrate`). Nothing here is measured on a TPU.
ASSUMED = {
    "weight_cycles": 0.5,   # MXU beats per weight vreg push per MXU: a vmatprep.subr + vlatch pair per beat
    "mxu_latency_per_column": 2.0,  # MXU push-to-result latency = 2*C beats (systolic fill and drain);
                                    # the fit is nearly flat in it (see the calibration json)
}


def calibration_path(chip: str = "tpu7x") -> pathlib.Path:
  """v5e: fitted on its own measured device times; v6e and TPU7x: on tokamax's published TPU7x timings."""
  return V5E_CALIBRATION_PATH if chip == "v5e" else CALIBRATION_PATH


def load_calibration(path: pathlib.Path | None = None, chip: str = "tpu7x") -> dict:
  """A frozen calibration (constants, the points, the fit and held-out errors): `path`, else the chip's."""
  return json.loads(pathlib.Path(calibration_path(chip) if path is None else path).read_text())


def model_params(calibration: dict | None = None, chip: str = "tpu7x") -> dict:
  """ASSUMED plus the FITTED constants (`step_s`: per grid step, `op_s`: per launched op) of `chip`'s
  calibration (v5e its own; v6e and TPU7x the TPU7x one)."""
  cal = load_calibration(chip=chip) if calibration is None else calibration
  return {**ASSUMED, **cal["fitted"]}


def calibration_label(chip: str) -> str:
  """What a chip's estimates are calibrated against (every figure stays an ESTIMATE)."""
  if chip == "v5e":
    return ("ESTIMATE, overheads fitted on device times measured on a TPU v5e "
            "(tools/tpu_cost_calibration_v5e.json; held-out error there)")
  if chip == "tpu7x":
    return "ESTIMATE, overheads fitted on tokamax's published TPU7x timings (no TPU7x ran here)"
  return f"ESTIMATE, {chip} uncalibrated: it reuses the TPU7x overheads (no {chip} ran)"


def lhs_push_cycles(chip: Chip) -> float:
  """MXU beats one MXU spends on one 32-bit LHS vreg push (8 rows x 128 deep x C columns at the
  published peak; 8*128/C); a packed bf16 push (16 rows) costs twice this."""
  return 2 * 8 * 128 * chip.mxu_columns * chip.clock_hz / (chip.bf16_flops / chip.num_mxus)


@dataclasses.dataclass
class Dumps:
  """The parsed dumps of one compile: its Mosaic kernels in call order and the wrapper's XLA totals."""
  kernels: list            # tools.tpu_llo.KernelCounts, one per custom call, in program order
  xla_cycles: int          # sum of XLA's estimated_cycles over the non-kernel ops
  xla_bytes: int           # 2 x result bytes of the non-free ops XLA gives no estimate for
  xla_ops: int             # launched non-kernel ops


def load_dumps(mosaic_dir: str | pathlib.Path, xla_dir: str | pathlib.Path) -> Dumps:
  """Parses one compile's Mosaic and XLA dump directories (see tools.tpu_llo, tools.tpu_hlo)."""
  kernels = [tpu_llo.parse_kernel(p) for p in tpu_llo.find_kernel_dumps(mosaic_dir)]
  ops = tpu_hlo.parse_entry(tpu_hlo.find_hlo_dump(xla_dir), [k.name for k in kernels])
  by_name: dict[str, list] = {}
  for k in kernels:
    by_name.setdefault(k.name, []).append(k)
  called, xla_cycles, xla_bytes, n = [], 0, 0, 0
  for op in ops:
    if op.kernel is not None:
      called.append(by_name[op.kernel].pop(0))
    elif op.opcode in tpu_hlo.FREE_OPCODES or op.opcode == "custom-call":
      continue  # a non-Mosaic custom call at top level is a buffer allocation
    elif op.opcode in ("async-start", "async-update"):
      continue  # an async op is counted once, at its async-done
    elif op.estimated_cycles is not None:
      xla_cycles += op.estimated_cycles
      n += 1
    else:
      xla_bytes += 2 * op.result_bytes
      n += 1
  unmatched = [k.name for ks in by_name.values() for k in ks]
  if unmatched:
    # A kernel launched from inside a loop or another computation runs an unknown number of times:
    # refuse rather than leave it out of the estimate.
    raise ValueError(f"Mosaic kernel(s) {unmatched} are not launched from the entry computation "
                     "(inside a loop or a called computation?); tools.tpu_cost cannot count them")
  return Dumps(called, xla_cycles, xla_bytes, n)


def profile(d: Dumps, chip: Chip, params: dict | None = None) -> dict:
  """The JSON-able per-kernel counts and XLA totals `estimate_seconds` needs (chain followed here)."""
  params = model_params() if params is None else params
  kernels = []
  for k in d.kernels:
    chain = k.chain_cycles(mxu_push_cycles=lhs_push_cycles(chip) / chip.num_mxus,
                           mxu_weight_cycles=params["weight_cycles"] / chip.num_mxus,
                           mxu_latency=params["mxu_latency_per_column"] * chip.mxu_columns)
    o = k.ops
    kernels.append({"name": k.name, "grid": list(k.grid), "steps": k.num_steps,
                    **{u: o.get(u, 0) for u in ("mxu_lhs", "mxu_lhs_packed", "mxu_weight", "mxu_pop", "vpu",
                                                "eup", "xlu", "vld", "vst", "scalar")},
                    "dma_bytes_per_step": k.dma_bytes_per_step, "chain_cycles": chain,
                    "unknown_trip_loops": k.unknown_trip_loops})
  return {"kernels": kernels, "xla_cycles": d.xla_cycles, "xla_bytes": d.xla_bytes, "xla_ops": d.xla_ops}


def estimate_seconds(prof: dict, chip: Chip, params: dict | None = None) -> dict:
  """ESTIMATED device seconds of one compiled program (`prof` from `profile`; formula in the
  module docstring). Returns `{"total_s", "kernels_s", "xla_s", "kernels": [{name, steps,
  step_us, bound}]}`, `bound` naming the term that sets each kernel's step time."""
  params = model_params() if params is None else params
  f = chip.clock_hz
  out_k, kern_s = [], 0.0
  for k in prof["kernels"]:
    terms = {"mxu_lhs": (k["mxu_lhs"] + k["mxu_lhs_packed"]) * lhs_push_cycles(chip) / chip.num_mxus,
             "mxu_weight": k["mxu_weight"] * params["weight_cycles"] / chip.num_mxus,
             "mxu_pop": k["mxu_pop"] / chip.num_mxus, "vpu": k["vpu"] / chip.n_valu, "eup": k["eup"],
             "xlu": k["xlu"] / chip.n_xlu, "vld": k["vld"], "vst": k["vst"], "chain": k["chain_cycles"]}
    bound = max(terms, key=terms.get)
    compute_s = terms[bound] / f
    dma_s = k["dma_bytes_per_step"] / chip.hbm_bytes_per_s
    if dma_s > compute_s:
      bound = "hbm"
    step_s = max(compute_s, dma_s) + params["step_s"]
    kern_s += k["steps"] * step_s + params["op_s"]
    out_k.append({"name": k["name"], "grid": k["grid"], "steps": k["steps"], "step_us": step_s * 1e6,
                  "bound": bound})
  xla_s = prof["xla_cycles"] / f + prof["xla_bytes"] / chip.hbm_bytes_per_s + prof["xla_ops"] * params["op_s"]
  return {"total_s": kern_s + xla_s, "kernels_s": kern_s, "xla_s": xla_s, "kernels": out_k}


# ----------------------------------------------------------------------------- compiling (child process)

_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_ACCELERATOR_TYPE": "v5litepod-1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
A_LOG, DT_BIAS, LOWER_BOUND = 0.0, -2.0, -5.0


def segment_ids(shape: Shape):
  """int32 [B, T] labels of `shape` (None for fixed length): 2 segments split at T/2-17 (the
  seed's, not 64-aligned), or n balanced segments (tokamax's arg spec)."""
  if shape.segments is None:
    return None
  t = shape.seq_len
  if shape.doc_lengths is not None:  # [T], shared by every row (as the v5e benchmark passes them)
    return np.repeat(np.arange(1, len(shape.doc_lengths) + 1), shape.doc_lengths).astype(np.int32)
  if shape.segments == 2:
    row = np.where(np.arange(t) < t // 2 - 17, 1, 2)
  else:
    base, extra = divmod(t, shape.segments)
    lens = np.full(shape.segments, base)
    lens[:extra] += 1
    row = np.repeat(np.arange(1, shape.segments + 1), lens)
  return np.broadcast_to(row.astype(np.int32), (shape.batch, t)).copy()


def _compile_child(chip: Chip, shape: Shape, impl: str) -> dict:
  """Compiles one forward for `chip` (dumps go where the parent's env says); returns memory stats."""
  if impl == "tokamax_mosaic" and "--tokamax_cross_compile" not in sys.argv:
    sys.argv.append("--tokamax_cross_compile")  # tokamax reads it at import: lets mosaic compile on CPU
  # jax starts libtpu at import: only the child compiles, after its dump flags are in the environment
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  topo = topologies.get_topology_desc(topology_name=chip.topology, platform="tpu")
  mesh = Mesh(np.array(topo.devices[:1]), ("x",))
  sh = NamedSharding(mesh, PartitionSpec())
  sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sh)
  b, t, h, k, v = shape.batch, shape.seq_len, shape.heads, shape.key_dim, shape.value_dim
  bf16 = jnp.dtype(shape.dtype)
  seg = segment_ids(shape)
  n = shape.segments
  if impl == "ours":
    # the op imports jax: child process only (the parent stays jax-free; see the module docstring)
    from kda_plugin.ops import inference
    choice = ({"implementation": "pallas_tpu"} if "implementation" in inspect.signature(inference.kda_inference).parameters
              else {"backend": "pallas_tpu"})

    def fn(q, kk, vv, g, beta, a_log, dt_bias, *seg_arg):
      o, final = inference.kda_inference(
          q, kk, vv, g, beta, segment_ids=seg_arg[0] if seg_arg else None, a_log=a_log, dt_bias=dt_bias,
          lower_bound=LOWER_BOUND, use_qk_l2norm=True, output_final_state=shape.output_final_state,
          max_num_segments=n, **({"num_heads": h} if shape.lane_dense else {}), **choice)
      return o, final
    lay = (lambda d: (b, t, h * d)) if shape.lane_dense else (lambda d: (b, t, h, d))
    args = [sds(lay(k), bf16), sds(lay(k), bf16), sds(lay(v), bf16), sds(lay(k), bf16),
            sds((b, t, h), bf16), sds((h,), jnp.float32), sds((h * k,), jnp.float32)]
  else:
    # tokamax reads --tokamax_cross_compile at import: imported only in the child, after it is set
    from tokamax._src.ops.kda.api import kimi_delta_attention

    def fn(q, kk, vv, g, beta, a_log, dt_bias, *seg_arg):
      kw = {}
      if seg is not None:
        kw = {"segment_ids": seg_arg[0] if seg_arg else jnp.asarray(seg), "max_num_segments": n}
      o, final = kimi_delta_attention(q, kk, vv, g, beta, a_log=a_log, delta_time_bias=dt_bias,
                                      use_gate_in_kernel=True, lower_bound=LOWER_BOUND, use_qk_l2norm=True,
                                      output_final_state=shape.output_final_state, implementation="mosaic", **kw)
      return (jnp.moveaxis(o, 0, 2) if shape.head_first_output else o), final
    args = [sds((h, b, t, k), bf16), sds((h, b, t, k), bf16), sds((h, b, t, v), bf16), sds((h, b, t, k), bf16),
            sds((h, b, t), bf16), sds((h,), jnp.float32), sds((h * k,), jnp.float32)]
  if seg is not None and shape.traced_segments:
    args.append(sds(seg.shape, jnp.int32))
  elif seg is not None and impl == "ours":
    inner = fn

    def fn(*a):  # the segment ids a compile-time constant, as in tokamax's arg spec
      return inner(*a, jnp.asarray(seg))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "temp_bytes": m.temp_size_in_bytes}


def compile_and_dump(chip: Chip, shape: Shape, impl: str, workdir: pathlib.Path, timeout: float = 900) -> dict:
  """Runs one compile in a child process with both dumps on; returns {memory, mosaic_dir, xla_dir}.

  Raises:
    RuntimeError: the child failed (its output tail is in the message).
  """
  mdir, xdir = workdir / "mosaic", workdir / "xla"
  env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(_TPU_ENV)
  env["LIBTPU_INIT_ARGS"] = f"--xla_mosaic_dump_to={mdir}"
  env["XLA_FLAGS"] = f"--xla_dump_to={xdir}"
  env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-m", "tools.tpu_cost", f"_child={chip.name}:{shape.name}:{impl}"],
                        env=env, capture_output=True, text=True, timeout=timeout)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines:
    tail = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    raise RuntimeError(f"compile of {impl} at {shape.name} for {chip.name} failed (exit {proc.returncode}): "
                       f"{tail[-1] if tail else 'no output'}")
  return {"memory": json.loads(lines[-1]), "mosaic_dir": mdir, "xla_dir": xdir}


def estimate(chip: Chip, shape: Shape, impl: str, params: dict | None = None, keep_dir: str | None = None) -> dict:
  """Compiles, parses and estimates one (chip, shape, impl); returns a JSON-able record.

  With `keep_dir`, the dumps stay there and are reused when already there (no recompile)."""
  params = model_params(chip=chip.name) if params is None else params
  with tempfile.TemporaryDirectory(prefix="tpu_cost_") as tmp:
    work = pathlib.Path(keep_dir) if keep_dir else pathlib.Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    if keep_dir and (work / "mosaic").is_dir() and (work / "xla").is_dir() and (work / "memory.json").is_file():
      c = {"memory": json.loads((work / "memory.json").read_text()), "mosaic_dir": work / "mosaic",
           "xla_dir": work / "xla"}
    else:
      c = compile_and_dump(chip, shape, impl, work)
      if keep_dir:
        (work / "memory.json").write_text(json.dumps(c["memory"]))
    prof = profile(load_dumps(c["mosaic_dir"], c["xla_dir"]), chip, params)
  est = estimate_seconds(prof, chip, params)
  return {"chip": chip.name, "shape": shape.name, "impl": impl, "estimated_ms": est["total_s"] * 1e3,
          "estimated_kernels_ms": est["kernels_s"] * 1e3, "estimated_xla_ms": est["xla_s"] * 1e3,
          "kernels": est["kernels"], "profile": prof, "memory": c["memory"], "label": "ESTIMATE",
          "calibration": calibration_label(chip.name)}


# ----------------------------------------------------------------------------- calibration

# tokamax 0.0.17 `mosaic` KDA forward, published on TPU v7x (one device = one TensorCore).
CALIBRATION_POINTS = (
    ("seed_t512", 0.322, "seed PR baseline column (docs/kda.md section 7): tokamax Mosaic forward, T=512"),
    ("seed", 1.326, "seed PR baseline column: tokamax Mosaic forward, T=8192"),
    ("tokamax_fixed", 1.777, "openxla/tokamax PR 1103: fixed length"),
    ("tokamax_packed", 3.942, "openxla/tokamax PR 1103: 25 packed segments"),
)
HELD_OUT = "tokamax_packed"  # chosen before fitting: the peer figure the kernel target is set against
FIT_GRID = {"step_s": [i * 0.01e-6 for i in range(0, 301)], "op_s": [i * 0.01e-6 for i in range(0, 1001)]}


def fit(profiles: dict[str, dict], published_ms: dict[str, float], held_out, chip: str = "tpu7x",
        grid: dict | None = None) -> dict:
  """Least squares in log time over the points not in `held_out` (one name, or a list), on `grid`
  (default FIT_GRID; deterministic).

  Returns {"fitted": {step_s, op_s}, "estimated_ms": {...}, "error_pct": {...}, "fit_rms_error_pct",
  "fit_max_abs_error_pct", "held_out_error_pct"} (one name: its error; a list: {name: error}, and
  "held_out_rms_error_pct", "held_out_max_abs_error_pct").
  """
  grid = FIT_GRID if grid is None else grid
  chip = CHIPS[chip]
  held = [held_out] if isinstance(held_out, str) else list(held_out)
  fit_names = [n for n in profiles if n not in held]
  # Total time is affine in op_s for a fixed step_s: evaluate the two pieces once per step_s.
  best = None
  for step_s in grid["step_s"]:
    base = {n: estimate_seconds(profiles[n], chip, {**ASSUMED, "step_s": step_s, "op_s": 0.0})["total_s"]
            for n in profiles}
    nops = {n: profiles[n]["xla_ops"] + len(profiles[n]["kernels"]) for n in profiles}
    for op_s in grid["op_s"]:
      loss = sum(math.log((base[n] + nops[n] * op_s) * 1e3 / published_ms[n]) ** 2 for n in fit_names)
      if best is None or loss < best[0]:
        best = (loss, step_s, op_s)
  fitted = {"step_s": best[1], "op_s": best[2]}
  est = {n: estimate_seconds(profiles[n], chip, {**ASSUMED, **fitted})["total_s"] * 1e3 for n in profiles}
  err = {n: 100.0 * (est[n] / published_ms[n] - 1.0) for n in profiles}
  out = {"fitted": fitted, "estimated_ms": est, "error_pct": err,
         "fit_rms_error_pct": math.sqrt(sum(err[n] ** 2 for n in fit_names) / len(fit_names)),
         "fit_max_abs_error_pct": max(abs(err[n]) for n in fit_names)}
  if isinstance(held_out, str):
    out["held_out_error_pct"] = err[held_out]
  else:
    out["held_out_error_pct"] = {n: err[n] for n in held}
    out["held_out_rms_error_pct"] = math.sqrt(sum(err[n] ** 2 for n in held) / len(held))
    out["held_out_max_abs_error_pct"] = max(abs(err[n]) for n in held)
  return out


def calibrate(held_out: str = HELD_OUT, keep_dir: str | None = None) -> dict:
  """Compiles tokamax mosaic at the four published points on TPU7x, fits, returns the calibration.

  With `keep_dir`, dumps are kept in keep_dir/<shape>/ and reused when already there (a refit
  without recompiling). Also reports how the fit moves with the assumed MXU latency L.
  """
  chip = CHIPS["tpu7x"]
  dumps, published = {}, {}
  for name, ms, _ in CALIBRATION_POINTS:
    with tempfile.TemporaryDirectory(prefix="tpu_cost_cal_") as tmp:
      work = pathlib.Path(keep_dir) / name if keep_dir else pathlib.Path(tmp)
      if not (work / "mosaic").is_dir() or not (work / "xla").is_dir():
        work.mkdir(parents=True, exist_ok=True)
        compile_and_dump(chip, SHAPES[name], "tokamax_mosaic", work)
      dumps[name] = load_dumps(work / "mosaic", work / "xla")
    published[name] = ms
  profiles = {n: profile(d, chip, ASSUMED) for n, d in dumps.items()}
  result = fit(profiles, published, held_out)
  sensitivity = []
  for per_column in (0.5, 1.0, 2.0, 4.0):
    alt = {**ASSUMED, "mxu_latency_per_column": per_column}
    r = fit({n: profile(d, chip, alt) for n, d in dumps.items()}, published, held_out)
    sensitivity.append({"mxu_latency_beats": per_column * chip.mxu_columns, "fitted": r["fitted"],
                        "fit_rms_error_pct": r["fit_rms_error_pct"], "held_out_error_pct": r["held_out_error_pct"]})
  return {"label": "ESTIMATE model calibration (no TPU ran; published timings vs compiled-kernel estimates)",
          "chip": "tpu7x", "impl": "tokamax_mosaic", "tokamax": "0.0.17", "held_out": held_out,
          "assumed": ASSUMED, "fitted": result["fitted"], "fit_grid": "step_s 0..3 us, op_s 0..10 us, 0.01 us steps",
          "points": [{"shape": n, "published_ms": published[n], "source": src, "held_out": n == held_out,
                      "estimated_ms": result["estimated_ms"][n], "error_pct": result["error_pct"][n],
                      "profile": profiles[n]} for n, _, src in CALIBRATION_POINTS],
          "fit_rms_error_pct": result["fit_rms_error_pct"],
          "fit_max_abs_error_pct": result["fit_max_abs_error_pct"],
          "held_out_error_pct": result["held_out_error_pct"],
          "mxu_latency_sensitivity": sensitivity}


def refit_from_json(cal: dict) -> dict:
  """Re-runs `fit` on the profiles stored in a calibration (no compile): must reproduce it."""
  profiles = {p["shape"]: p["profile"] for p in cal["points"]}
  key = "measured_ms" if cal["chip"] == "v5e" else "published_ms"
  published = {p["shape"]: p[key] for p in cal["points"]}
  return fit(profiles, published, cal["held_out"], chip=cal["chip"],
             grid=V5E_FIT_GRID if cal["chip"] == "v5e" else FIT_GRID)


# ----------------------------------------------------------------------------- v5e calibration

# Held out of the v5e fit, chosen by kind before any fit was run: another dtype (f32, whose step is
# MXU-bound in the model), many 64-token documents at T=4096, and a batch of 16 rows.
V5E_HELD_OUT = ("seed_f32", "t4096_h24_64x64", "b16_t2048_h8_4docs")
V5E_FIT_GRID = {"step_s": [i * 0.01e-6 for i in range(0, 1001)], "op_s": [i * 0.01e-6 for i in range(0, 1001)]}


def v5e_measurements(path: pathlib.Path = V5E_MEASUREMENTS_PATH) -> dict[str, float]:
  """Median device ms of the kernel (prefill) cases measured on the TPU v5e, by case name."""
  data = json.loads(pathlib.Path(path).read_text())
  return {c["name"]: c["median_ms"] for c in data["cases"] if c["name"] in _V5E_CASES}


def calibrate_v5e(held_out=V5E_HELD_OUT, keep_dir: str | None = None) -> dict:
  """Compiles ours for v5e at the nine measured prefill cases, fits step_s and op_s on those not held
  out (log least squares on V5E_FIT_GRID), returns the calibration (keep_dir: as `calibrate`)."""
  chip = CHIPS["v5e"]
  measured = v5e_measurements()
  missing = [n for n in _V5E_CASES if n not in measured]
  if missing:
    raise ValueError(f"{V5E_MEASUREMENTS_PATH} has no median for {missing}")
  profiles = {}
  for name in _V5E_CASES:
    with tempfile.TemporaryDirectory(prefix="tpu_cost_cal_") as tmp:
      work = pathlib.Path(keep_dir) / f"v5e_{name}_ours" if keep_dir else pathlib.Path(tmp)
      if not (work / "mosaic").is_dir() or not (work / "xla").is_dir():
        work.mkdir(parents=True, exist_ok=True)
        compile_and_dump(chip, SHAPES[name], "ours", work)
      profiles[name] = profile(load_dumps(work / "mosaic", work / "xla"), chip, ASSUMED)
  result = fit(profiles, measured, held_out, chip="v5e", grid=V5E_FIT_GRID)
  meta = json.loads(V5E_MEASUREMENTS_PATH.read_text())
  return {"label": ("ESTIMATE model calibration for v5e: compiled-kernel estimates (libtpu ahead of time) "
                    "against device times measured on a real TPU v5e"),
          "chip": "v5e", "impl": "ours",
          "measurements": {"file": str(V5E_MEASUREMENTS_PATH.relative_to(V5E_MEASUREMENTS_PATH.parents[2])),
                           "commit": meta["commit"], "jax": meta["jax"], "device": meta["device"],
                           "statistic": "median device ms (lax.fori_loop of calls in one jit)"},
          "held_out": list(held_out), "assumed": ASSUMED, "fitted": result["fitted"],
          "fit_grid": "step_s 0..10 us, op_s 0..10 us, 0.01 us steps",
          "points": [{"shape": n, "measured_ms": measured[n], "held_out": n in held_out,
                      "estimated_ms": result["estimated_ms"][n], "error_pct": result["error_pct"][n],
                      "profile": profiles[n]} for n in _V5E_CASES],
          **{k: result[k] for k in ("fit_rms_error_pct", "fit_max_abs_error_pct", "held_out_error_pct",
                                    "held_out_rms_error_pct", "held_out_max_abs_error_pct")}}


# ----------------------------------------------------------------------------- CLI

KEYS = ("chip", "shape", "impl", "output_json", "calibrate", "calibration_out", "keep_dumps")


def _parse(argv: list[str]) -> dict:
  kv = parse_key_values(argv, KEYS + ("_child",), error=UsageError)
  out = {"calibrate": kv.get("calibrate", "0")}
  if out["calibrate"] not in ("0", "1", "v5e"):
    raise UsageError(f"calibrate must be 0, 1 (TPU7x, tokamax) or v5e, got {out['calibrate']!r}")
  def listed(key, known, default):
    vals = [x for x in kv.get(key, default).split(",") if x]
    bad = [x for x in vals if x not in known]
    if bad or not vals:
      raise UsageError(f"{key} must be a comma list of {', '.join(known)}; got {kv.get(key)!r}")
    return vals
  out["chips"] = listed("chip", tuple(CHIPS), "tpu7x")
  out["shapes"] = listed("shape", tuple(SHAPES), "seed")
  out["impls"] = listed("impl", IMPLS, ",".join(IMPLS))
  for k in ("output_json", "calibration_out", "keep_dumps", "_child"):
    out[k] = kv.get(k)
  if out["output_json"] is not None and not out["output_json"]:
    raise UsageError("output_json needs a path")
  return out


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help", "help") for a in argv):
    print(__doc__)
    print(f"keys: chip ({', '.join(CHIPS)}; comma list), shape ({', '.join(SHAPES)}; comma list), impl "
          f"({', '.join(IMPLS)}; comma list), output_json=PATH, calibrate=0|1|v5e (1: refit on tokamax's "
          f"TPU7x timings; v5e: on the v5e measurements; writes calibration_out=PATH, default prints only), "
          f"keep_dumps=DIR")
    return 0
  try:
    args = _parse(argv)
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jax") is None:
    print(f"error: {sys.executable} has no jax + libtpu: run this tool with .venv-tpu-aot/bin/python "
          "(`make install-aot` creates it)", file=sys.stderr)
    return 2
  if args["_child"]:
    chip, shape, impl = args["_child"].split(":")
    print(json.dumps(_compile_child(CHIPS[chip], SHAPES[shape], impl)))
    return 0
  if args["calibrate"] == "v5e":
    cal = calibrate_v5e(keep_dir=args["keep_dumps"])
    if args["calibration_out"]:
      with atomic_writer(args["calibration_out"]) as f:
        json.dump(cal, f, indent=1)
    print("ESTIMATES (ours on v5e, compiled-kernel model) vs measured on a TPU v5e (median device ms):")
    for p in cal["points"]:
      print(f"  {p['shape']:20s} measured {p['measured_ms']:.4f} ms  estimated {p['estimated_ms']:.4f} ms  "
            f"{p['error_pct']:+.1f}%  {'held out' if p['held_out'] else 'fit'}")
    print(f"  fit rms {cal['fit_rms_error_pct']:.1f}% (max {cal['fit_max_abs_error_pct']:.1f}%), held-out rms "
          f"{cal['held_out_rms_error_pct']:.1f}% (max {cal['held_out_max_abs_error_pct']:.1f}%)")
    print(json.dumps({k: cal[k] for k in ("fitted", "fit_rms_error_pct", "held_out_error_pct",
                                          "held_out_rms_error_pct", "held_out_max_abs_error_pct")}))
    return 0
  if args["calibrate"] == "1":
    cal = calibrate(keep_dir=args["keep_dumps"])
    if args["calibration_out"]:
      with atomic_writer(args["calibration_out"]) as f:
        json.dump(cal, f, indent=1)
    print("ESTIMATES (tokamax mosaic on TPU7x, compiled-kernel model) vs published:")
    for p in cal["points"]:
      print(f"  {p['shape']:15s} published {p['published_ms']:.3f} ms  estimated {p['estimated_ms']:.3f} ms  "
            f"{p['error_pct']:+.1f}%{'  (held out)' if p['held_out'] else ''}")
    print(f"  fit rms {cal['fit_rms_error_pct']:.1f}%, held-out {cal['held_out_error_pct']:+.1f}%")
    print(json.dumps({k: cal[k] for k in ("fitted", "fit_rms_error_pct", "fit_max_abs_error_pct", "held_out_error_pct")}))
    return 0
  try:
    params = {c: model_params(chip=c) for c in args["chips"]}
  except (OSError, KeyError, json.JSONDecodeError) as e:
    print(f"error: cannot read a calibration ({CALIBRATION_PATH.name} or {V5E_CALIBRATION_PATH.name}): {e}",
          file=sys.stderr)
    return 2
  records = []
  for chip in args["chips"]:
    for shape in args["shapes"]:
      for impl in args["impls"]:
        keep = os.path.join(args["keep_dumps"], f"{chip}_{shape}_{impl}") if args["keep_dumps"] else None
        try:
          records.append(estimate(CHIPS[chip], SHAPES[shape], impl, params[chip], keep))
        except (RuntimeError, FileNotFoundError, ValueError) as e:
          print(f"error: {e}", file=sys.stderr)  # nothing was written to output_json
          return 1
        r = records[-1]
        print(f"ESTIMATE {chip:6s} {shape:15s} {impl:15s} {r['estimated_ms']:8.3f} ms  (kernels "
              f"{r['estimated_kernels_ms']:.3f}, XLA ops {r['estimated_xla_ms']:.3f}; "
              + ", ".join(f"{k['name']} {k['steps']} steps x {k['step_us']:.2f} us {k['bound']}" for k in r["kernels"]) + ")")
  summary = {"label": "ESTIMATE: compiled-kernel cost model (tools/tpu_cost.py), no TPU ran",
             "calibration": {c: {"label": calibration_label(c), **{k: load_calibration(chip=c)[k] for k in (
                 "fitted", "fit_rms_error_pct", "held_out_error_pct")}} for c in args["chips"]},
             "estimates": {c: {s: {r["impl"]: {"estimated_ms": r["estimated_ms"]} for r in records
                                   if r["chip"] == c and r["shape"] == s} for s in args["shapes"]} for c in args["chips"]}}
  if args["output_json"]:
    with atomic_writer(args["output_json"]) as f:
      json.dump({**summary, "records": records}, f, indent=1)
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
