"""Reads Mosaic's post-finalize-llo dump (the compiled TPU kernel) and counts what one grid step issues.

`LIBTPU_INIT_ARGS=--xla_mosaic_dump_to=DIR` makes libtpu write every Mosaic pass of every kernel it
compiles as `<id>-<NNNN>-mosaic-dump-<kernel>-<pass>.txt`; the last pass, `post-finalize-llo`, is
the instruction stream of one grid step (LLO: vreg-level ops on 8x128 32-bit vector registers,
MXU pushes and pops, DMA and scalar ops) plus the index maps (`@transform_i`) of the pipelined
operands. This module parses that text with no libtpu and no jax, keyed off op names (never line
positions), so it keeps working when the kernel changes.

Per grid step it reports, per unit (`UNIT_OF`): MXU operand pushes (LHS `vmatmul`/`vmatprep.mubr`
and weight `vmatprep.subr`/`vlatchi`, per `mxu_id`), result pops (`vmatres`), VPU ops, EUP ops
(transcendentals), XLU ops (lane rotates, transposes, permutes), vector loads and stores, scalar
ops, and the bytes the Pallas pipeline copies between HBM and VMEM (window blocks: an operand
whose index map ignores the innermost grid index is copied once per innermost sweep, as Pallas
skips a copy whose block index did not change). `scf.for` bodies are multiplied by their trip
count when the bounds are constants (else counted once and reported in `unknown_trip_loops`);
both branches of an `scf.if` are counted (an upper bound).

It also follows the serial dependency chain through SSA values (`critical_path_cycles`): each op
is ready when its operands are; MXU pushes on one `mxu_id` queue behind each other, and a
`vmatres` pop waits `mxu_latency` cycles after the last push it drains. The latencies are not
published by Google; `tools/tpu_cost.py` fits the MXU one in its calibration and passes it in.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

DUMP_PASS = "post-finalize-llo"

# Unit of each LLO op, by name prefix (first match wins; checked in this order).
_UNIT_RULES: tuple[tuple[str, str], ...] = (
    ("llo.vmatmul", "mxu_lhs"), ("llo.vmatprep.mubr", "mxu_lhs"),
    ("llo.vmatprep.subr", "mxu_weight"), ("llo.vlatch", "mxu_weight"),
    ("llo.vmatres", "mxu_pop"), ("llo.vdwg", "mxu_ctrl"),
    ("llo.vexp", "eup"), ("llo.vpow2", "eup"), ("llo.vlog", "eup"), ("llo.vlogistic", "eup"),
    ("llo.vrcp", "eup"), ("llo.vrsqrt", "eup"), ("llo.vsqrt", "eup"), ("llo.vtanh", "eup"),
    ("llo.vsin", "eup"), ("llo.vcos", "eup"), ("llo.verf", "eup"), ("llo.vpop", "eup_pop"),
    ("llo.vrot.lane", "xlu"), ("llo.vxpose", "xlu"), ("llo.vperm", "xlu"), ("llo.vlbroadcast", "xlu"),
    ("llo.vreduce", "xlu"), ("llo.vxlane", "xlu"), ("llo.vsort", "xlu"), ("llo.vlane", "xlu"),
    ("llo.vector_load", "vld"), ("llo.vld", "vld"),
    ("llo.vector_store", "vst"), ("llo.vst", "vst"),
    ("llo.vbitcast", "free"), ("llo.constant", "free"),
    ("llo.dma", "dma"), ("llo.enqueue_dma", "dma"),
    ("llo.v", "vpu"),
    ("llo.s", "scalar"),
)
UNITS = ("mxu_lhs", "mxu_lhs_packed", "mxu_weight", "mxu_pop", "mxu_ctrl", "eup", "eup_pop", "xlu", "vld", "vst", "vpu",
         "scalar", "dma", "free", "other")


def unit_of(op: str) -> str:
  """The unit (`UNITS`) that issues LLO op `op` (e.g. `llo.vmatmul.mubr` -> `mxu_lhs`)."""
  for prefix, unit in _UNIT_RULES:
    if op.startswith(prefix):
      return unit
  return "other"


_DTYPE_BYTES = {"f32": 4, "i32": 4, "si32": 4, "ui32": 4, "bf16": 2, "f16": 2, "i16": 2, "i8": 1,
                "si8": 1, "ui8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "i1": 1, "f64": 8, "i64": 8}

_RES_RE = re.compile(r"^((?:%[\w.$-]+(?::\d+)?\s*,\s*)*%[\w.$-]+(?::\d+)?)\s*=\s*(.*)$")
_OPNAME_RE = re.compile(r'^"?([a-z_]+\.[\w.]+)"?')
_VALUE_RE = re.compile(r"%[\w.$-]+")
_MXU_ID_RE = re.compile(r"mxu_id\s*=\s*(\d+)")
_CONST_RE = re.compile(r"value\s*=\s*(-?\d+)\s*:")
_ARITH_CONST_RE = re.compile(r"arith\.constant\s+(-?\d+)\s*:")
_FOR_RE = re.compile(r"scf\.for\s+(%[\w.$-]+)\s*=\s*(%[\w.$-]+)\s+to\s+(%[\w.$-]+)\s+step\s+(%[\w.$-]+)")


@dataclasses.dataclass
class Window:
  """One pipelined operand: its VMEM block (`window_bounds`) and bytes per copy (tile-padded)."""
  name: str
  block_shape: tuple[int, ...]
  dtype: str
  block_bytes: int
  varies_with_inner: bool  # its index map reads the innermost grid index


@dataclasses.dataclass
class KernelCounts:
  """What one grid step of one compiled Mosaic kernel issues (see the module docstring)."""
  name: str
  path: str
  grid: tuple[int, ...]
  dimension_semantics: tuple[str, ...]
  ops: dict[str, int]                 # unit -> ops per grid step
  op_names: dict[str, int]            # LLO op name -> count per grid step
  mxu_lhs_per_mxu: dict[int, int]     # mxu_id -> LHS pushes per step
  mxu_weight_per_mxu: dict[int, int]  # mxu_id -> weight pushes per step
  windows: list[Window]
  dma_bytes_per_step: float           # pipelined HBM<->VMEM bytes per step (revisits skipped)
  critical_path_cycles: float         # serial chain through one step (latencies as passed in)
  unknown_trip_loops: int
  body: list[str] = dataclasses.field(default_factory=list, repr=False)  # the step's LLO text

  def chain_cycles(self, *, latency: dict[str, float] | None = None, mxu_push_cycles: float,
                   mxu_weight_cycles: float, mxu_latency: float) -> float:
    """`critical_path` of this kernel's grid step with other latencies (cycles)."""
    return critical_path(self.body, latency or {}, mxu_push_cycles, mxu_latency,
                         mxu_weight_cycles=mxu_weight_cycles)

  @property
  def num_steps(self) -> int:
    return math.prod(self.grid) if self.grid else 1

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.pop("body")
    d["num_steps"] = self.num_steps
    d["mxu_lhs_per_mxu"] = {str(k): v for k, v in self.mxu_lhs_per_mxu.items()}
    d["mxu_weight_per_mxu"] = {str(k): v for k, v in self.mxu_weight_per_mxu.items()}
    return d


def find_kernel_dumps(dump_dir: str | pathlib.Path) -> list[pathlib.Path]:
  """The post-finalize-llo files under `dump_dir`, one per compiled kernel, in compile order.

  Raises:
    FileNotFoundError: no such file (the compile made no Mosaic kernel, or dumping was off).
  """
  paths = sorted(pathlib.Path(dump_dir).rglob(f"*-mosaic-dump-*-{DUMP_PASS}.txt"))
  if not paths:
    raise FileNotFoundError(f"no *-{DUMP_PASS}.txt under {dump_dir}: was LIBTPU_INIT_ARGS="
                            f"--xla_mosaic_dump_to set, and did the program contain a Pallas TPU kernel?")
  return paths


def _memref_bytes(memref: str) -> tuple[tuple[int, ...], str, int]:
  """Shape, dtype and tile-padded bytes of `memref<AxBx...xDT, #xir.tiled<(r,c)...>, ...>`."""
  body = memref[len("memref<"):]
  dims_dtype = body.split(",", 1)[0].strip()
  parts = dims_dtype.split("x")
  dtype = parts[-1]
  shape = tuple(int(p) for p in parts[:-1])
  tile = re.search(r"#xir\.tiled<\((\d+)(?:,(\d+))?\)", memref)
  padded = list(shape)
  if tile and padded:
    t = [int(tile.group(1))] + ([int(tile.group(2))] if tile.group(2) else [])
    for i, tt in enumerate(reversed(t)):
      j = len(padded) - 1 - i
      if j >= 0:
        padded[j] = -(-padded[j] // tt) * tt
  itemsize = _DTYPE_BYTES.get(dtype, 4)
  return shape, dtype, math.prod(padded) * itemsize


def _split_funcs(text: str) -> dict[str, tuple[str, list[str]]]:
  """`{func name: (signature line, body lines)}` for each top-level `func.func` of the module."""
  funcs: dict[str, tuple[str, list[str]]] = {}
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    m = re.match(r"\s*func\.func\s+(?:private\s+)?@([\w$.-]+)\(", line)
    if not m:
      i += 1
      continue
    name, sig, body, depth = m.group(1), line, [], line.count("{") - line.count("}")
    # The signature's attribute dict opens and closes on this line; the body opens with the last `{`.
    i += 1
    while i < len(lines) and depth > 0:
      ln = lines[i]
      depth += _brace_delta(ln)
      if depth > 0:
        body.append(ln)
      i += 1
    funcs[name] = (sig, body)
  return funcs


def _brace_delta(line: str) -> int:
  """Net region braces opened by a line (braces inside quoted strings and `<{...}>` cancel out)."""
  s = re.sub(r'"[^"]*"', "", line)
  return s.count("{") - s.count("}")


def _parse_signature(sig: str) -> tuple[tuple[int, ...], tuple[str, ...], list[tuple[str, str]], int, int, int]:
  """(grid, dimension semantics, [(arg name, llo.type)], #scalar prefetch, #windows, #scratch)."""
  grid_m = re.search(r"iteration_bounds\s*=\s*array<i64(?::\s*([\d,\s]*))?>", sig)
  grid = tuple(int(x) for x in grid_m.group(1).split(",")) if grid_m and grid_m.group(1) else ()
  sem = tuple(re.findall(r"dimension_semantics<(\w+)>", sig))
  args = _signature_args(sig)
  sp = re.search(r"scalar_prefetch\s*=\s*(\d+)", sig)
  sc = re.search(r"scratch_operands\s*=\s*(\d+)", sig)
  nwin = len(re.findall(r"transform_indices\s*=", sig))
  if nwin == 0:
    nwin = len(re.findall(r"window_bounds\s*=", sig))
  return (grid, sem, args, int(sp.group(1)) if sp else 0, nwin, int(sc.group(1)) if sc else 0)


def _signature_args(sig: str) -> list[tuple[str, str]]:
  """[(arg name, llo.type)] of the main function, in order; a pass-through operand (left in HBM or
  ANY memory, copied by the kernel itself) gets its type prefixed with `passthrough:`."""
  params = sig[sig.index("(") + 1:]
  out = []
  for m in re.finditer(r"(%[\w.$-]+):\s*[\w]+\s*\{", params):
    depth, j = 1, m.end()
    while j < len(params) and depth:
      depth += {"{": 1, "}": -1}.get(params[j], 0)
      j += 1
    attrs = params[m.end():j - 1]
    t = re.search(r"llo\.type\s*=\s*(memref<.*?>>|[\w]+)(?:,|$)", attrs)
    typ = t.group(1) if t else "?"
    out.append((m.group(1), ("passthrough:" + typ) if "passthrough_operand" in attrs else typ))
    if params[j:j + 1] == ")" or params[j:].lstrip().startswith(")"):
      break
  return out


def _window_bounds(sig: str) -> list[tuple[str | None, tuple[int, ...] | None]]:
  """[(transform func name, window_bounds)] per window param, in operand order."""
  out = []
  wp = re.search(r"window_params\s*=\s*\[(.*?)\]\s*,\s*xir\.", sig) or re.search(r"window_params\s*=\s*\[(.*)\]", sig)
  if not wp:
    return out
  for entry in re.findall(r"\{([^{}]*)\}", wp.group(1)):
    t = re.search(r"transform_indices\s*=\s*@([\w$.-]+)", entry)
    b = re.search(r"window_bounds\s*=\s*array<i64(?::\s*([\d,\s]*))?>", entry)
    bounds = tuple(int(x) for x in b.group(1).split(",")) if b and b.group(1) else (() if b else None)
    out.append((t.group(1) if t else None, bounds))
  return out


def _reads_arg(body: list[str], sig: str, arg_index: int) -> bool:
  """Whether the index map (`body` of a transform func) depends on its `arg_index`-th argument."""
  args = re.findall(r"(%[\w.$-]+):\s*i32", sig.split("->")[0])
  if arg_index >= len(args):
    return False
  tainted = {args[arg_index]}
  for line in body:
    s = line.strip()
    m = _RES_RE.match(s)
    rhs = m.group(2) if m else s
    used = set(_VALUE_RE.findall(rhs))
    if s.startswith(("return", "func.return", "llo.return")) or "return" in rhs.split("(")[0]:
      if used & tainted:
        return True
      continue
    if m and used & tainted:
      tainted.update(_VALUE_RE.findall(m.group(1)))
  return False


@dataclasses.dataclass
class _Walk:
  ops: dict[str, float]
  names: dict[str, float]
  lhs: dict[int, float]
  weight: dict[int, float]
  unknown_loops: int = 0
  vmem_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # VMEM memref arg -> bytes
  dma_bytes: float = 0.0  # bytes of the kernel's own DMAs (llo.enqueue_dma)


def _opens_region(line: str, rhs: str) -> bool:
  """Whether `line` opens the region(s) of an scf.for / scf.if / scf.while."""
  return _brace_delta(line) > 0 and ("scf.for" in rhs or "scf.if" in rhs or "scf.while" in rhs)


def _region(lines: list[str], i: int) -> tuple[list[str], int]:
  """The lines inside the region(s) opened at `lines[i]`, up to the matching close, and the index
  of the line after that close."""
  depth, j, region = _brace_delta(lines[i].strip()), i + 1, []
  while j < len(lines) and depth > 0:
    depth += _brace_delta(lines[j])
    if depth > 0:
      region.append(lines[j])
    j += 1
  return region, j


def _trip_count(rhs: str, consts: dict[str, int]) -> int | None:
  """Iterations of the region op `rhs`: an scf.for's static trip count, 1 for an scf.if, None when
  not known (a bound that is not a constant, or an scf.while)."""
  fm = _FOR_RE.search(rhs)
  if fm:
    lb, ub, st = (consts.get(fm.group(k)) for k in (2, 3, 4))
    if None in (lb, ub, st) or st == 0:
      return None
    return max(0, -(-(ub - lb) // st))
  return None if "scf.while" in rhs else 1


def _count(lines: list[str], consts: dict[str, int], mult: float, w: _Walk) -> None:
  """Counts ops of a region (`lines`) `mult` times, descending into scf.for/scf.if regions."""
  i = 0
  while i < len(lines):
    s = lines[i].strip()
    m = _RES_RE.match(s)
    rhs = m.group(2) if m else s
    cm = _CONST_RE.search(rhs) if rhs.startswith("llo.constant") else _ARITH_CONST_RE.search(rhs)
    if m and cm and ("llo.constant" in rhs or "arith.constant" in rhs):
      consts[m.group(1).split(",")[0].split(":")[0].strip()] = int(cm.group(1))
    if _opens_region(s, rhs):
      region, j = _region(lines, i)
      trips = _trip_count(rhs, consts)
      if trips is None:
        w.unknown_loops += 1
        trips = 1
      _count([r for r in region if r.strip() not in ("} else {",)], consts, mult * trips, w)
      i = j
      continue
    om = _OPNAME_RE.match(rhs)
    if om and not rhs.startswith(("scf.", "func.", "}")):
      op = om.group(1)
      unit = unit_of(op)
      if op.startswith(("arith.", "memref.", "vector.", "index.")):
        unit = "scalar" if op.startswith(("arith.", "index.")) else "other"
      w.ops[unit] = w.ops.get(unit, 0) + mult
      w.names[op] = w.names.get(op, 0) + mult
      if op == "llo.enqueue_dma":
        # Its VMEM side (a scratch or window buffer) sizes the copy: an upper bound for sub-slices.
        side = next((w.vmem_bytes[v] for v in _VALUE_RE.findall(rhs) if v in w.vmem_bytes), 0)
        w.dma_bytes += side * mult
      if unit == "mxu_lhs" and "x2xbf16" in rhs:
        w.ops["mxu_lhs_packed"] = w.ops.get("mxu_lhs_packed", 0) + mult
      if unit in ("mxu_lhs", "mxu_weight"):
        mid = _MXU_ID_RE.search(rhs)
        d = w.lhs if unit == "mxu_lhs" else w.weight
        k = int(mid.group(1)) if mid else 0
        d[k] = d.get(k, 0) + mult
    i += 1


def critical_path(lines: list[str], latency: dict[str, float], mxu_push_cycles: float,
                  mxu_latency: float, consts: dict[str, int] | None = None, *,
                  mxu_weight_cycles: float = 1.0) -> float:
  """Cycles of the longest dependent chain through one grid step (loops: trips x body chain).

  Each op finishes `latency[unit]` cycles after its last operand is ready (default 1). MXU pushes
  occupy two ports in program order: weight vregs (`mxu_weight_cycles` each) and LHS vregs
  (`mxu_push_cycles` per 32-bit vreg, twice that for a packed bf16 vreg, which carries 16 rows).
  Weight staging (`vmatprep.subr`) overlaps the LHS stream; a latch (`vlatch*`) waits for the LHS
  stream before it, and LHS pushes wait for the latch. A `vmatres` is ready `mxu_latency` cycles
  after the last push before it; pops leave one per cycle. Callers pass per-push costs already
  divided by the number of MXUs the pushes spread over (`mxu_id` is 0 throughout at this pass).
  """
  consts = {} if consts is None else consts
  ready: dict[str, float] = {}
  wport = lport = latched = pushed = popped = 0.0  # MXU weight / LHS ports, last latch, push, pop
  end = 0.0
  i = 0
  while i < len(lines):
    s = lines[i].strip()
    m = _RES_RE.match(s)
    rhs = m.group(2) if m else s
    if m and ("llo.constant" in rhs or "arith.constant" in rhs):
      cm = _CONST_RE.search(rhs) or _ARITH_CONST_RE.search(rhs)
      if cm:
        consts[m.group(1).split(":")[0].strip()] = int(cm.group(1))
    if _opens_region(s, rhs):
      region, j = _region(lines, i)
      trips = _trip_count(rhs, consts)
      trips = 1 if trips is None else trips
      # The region starts when every value it reads from outside is ready (operands of the op
      # line and values captured by the body), and its iterations are taken as serial.
      outside = set(_VALUE_RE.findall(rhs)).union(*(_VALUE_RE.findall(r) for r in region))
      start = max([ready.get(v, 0.0) for v in outside] + [0.0])
      inner = critical_path([r for r in region if r.strip() != "} else {"], latency, mxu_push_cycles,
                            mxu_latency, dict(consts), mxu_weight_cycles=mxu_weight_cycles)
      t = start + trips * inner
      if m:
        for r in _VALUE_RE.findall(m.group(1)):
          ready[r] = t
      end = max(end, t)
      i = j
      continue
    om = _OPNAME_RE.match(rhs)
    if om and not rhs.startswith(("scf.", "func.", "}")):
      op = om.group(1)
      unit = unit_of(op)
      start = max([ready.get(v, 0.0) for v in _VALUE_RE.findall(rhs)] + [0.0])
      if unit == "mxu_weight" and op.startswith("llo.vmatprep"):
        # Staging the next weights overlaps the current LHS stream (the weights are double-buffered).
        t = max(start, wport) + mxu_weight_cycles
        wport = t
      elif unit == "mxu_weight":
        # A latch commits staged weights: after the staging before it and the LHS stream it replaces.
        t = max(start, wport, lport) + mxu_weight_cycles
        wport = t
        latched = t
      elif unit == "mxu_lhs":
        t = max(start, lport, latched) + mxu_push_cycles * (2.0 if "x2xbf16" in rhs else 1.0)
        lport = t
        pushed = t
      elif unit == "mxu_pop":
        t = max(start, pushed + mxu_latency, popped + 1.0)
        popped = t
      else:
        t = start + (0.0 if unit == "free" else latency.get(unit, 1.0))
      if m:
        for r in _VALUE_RE.findall(m.group(1)):
          ready[r] = t
      end = max(end, t)
    i += 1
  return end


def parse_kernel(path: str | pathlib.Path, *, latency: dict[str, float] | None = None,
                 mxu_push_cycles: float = 8.0, mxu_weight_cycles: float = 1.0,
                 mxu_latency: float = 128.0) -> KernelCounts:
  """Counts one post-finalize-llo dump (see the module docstring); latencies in cycles.

  Raises:
    ValueError: the file has no `xir.main` kernel function.
  """
  path = pathlib.Path(path)
  text = path.read_text()
  funcs = _split_funcs(text)
  main = next((n for n, (sig, _) in funcs.items() if "xir.main" in sig), None)
  if main is None:
    raise ValueError(f"{path}: no func.func with the xir.main attribute (not a {DUMP_PASS} dump?)")
  sig, body = funcs[main]
  grid, sem, args, n_prefetch, n_win, _ = _parse_signature(sig)
  wbounds = _window_bounds(sig)
  first = len(grid) + n_prefetch
  windows = []
  dma = 0.0
  inner = grid[-1] if grid else 1
  for k, (tname, bounds) in enumerate(wbounds):
    if first + k >= len(args):
      break
    aname, atype = args[first + k]
    if not atype.startswith("memref<"):
      continue  # left in HBM/ANY (pass-through): the kernel copies it itself (llo.enqueue_dma)
    shape, dtype, nbytes = _memref_bytes(atype)
    if "memory_space<vmem" not in atype:
      continue
    varies = True
    if tname and tname in funcs and grid:
      tsig, tbody = funcs[tname]
      varies = _reads_arg(tbody, tsig, len(grid) - 1)
    windows.append(Window(aname.lstrip("%"), tuple(bounds or shape), dtype, nbytes, varies))
    dma += nbytes if (varies or inner <= 1) else nbytes / inner
  w = _Walk({}, {}, {}, {})
  w.vmem_bytes = {a: _memref_bytes(t)[2] for a, t in args[first:]
                  if t.startswith("memref<") and "memory_space<vmem" in t}
  _count(body, {}, 1.0, w)
  dma += w.dma_bytes
  cp = critical_path(body, latency or {}, mxu_push_cycles, mxu_latency, mxu_weight_cycles=mxu_weight_cycles)
  as_int = lambda d: {k: int(round(v)) for k, v in d.items()}
  return KernelCounts(name=main, path=str(path), grid=grid, dimension_semantics=sem, ops=as_int(w.ops),
                      op_names=as_int(w.names), mxu_lhs_per_mxu=as_int(w.lhs),
                      mxu_weight_per_mxu=as_int(w.weight), windows=windows, dma_bytes_per_step=dma,
                      critical_path_cycles=cp, unknown_trip_loops=w.unknown_loops, body=body)
