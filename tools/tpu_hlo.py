"""Reads XLA's dumped, compiled TPU HLO (`XLA_FLAGS=--xla_dump_to=DIR`, `*.after_codegen.txt`): the
top-level ops of the entry computation, XLA's own cycle estimate for each (`estimated_cycles` in
the op's `window_config`), the bytes of its result, and which Mosaic kernel each `tpu_custom_call`
runs (its serialized `body` names the kernel function that `tools.tpu_llo` reads from the Mosaic
dump). No libtpu or jax needed.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import pathlib
import re

# Ops that move no data at run time (layout-only or bookkeeping).
FREE_OPCODES = frozenset({"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all",
                          "partition-id", "replica-id", "opt-barrier", "copy-start", "async-start",
                          "add-dependency"})

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
_SHAPE_RE = re.compile(r"\b(pred|[subf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")


@dataclasses.dataclass
class HloOp:
  """One top-level op of the compiled entry computation."""
  name: str
  opcode: str
  result_bytes: int
  estimated_cycles: int | None  # XLA's own estimate, None where it gives none
  kernel: str | None = None     # the Mosaic kernel a tpu_custom_call runs


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE_RE.findall(text):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += n * _DTYPE_BYTES.get(dtype, 4)
  return total


def find_hlo_dump(dump_dir: str | pathlib.Path) -> pathlib.Path:
  """The compiled module of the program: among the `*after_codegen.txt` files (XLA also dumps
  small helper modules, e.g. constants folded by a separate jit), the largest that launches a
  Mosaic kernel, else the largest.

  Raises:
    FileNotFoundError: none there (XLA_FLAGS=--xla_dump_to was not set for the compile).
  """
  paths = sorted(pathlib.Path(dump_dir).glob("*after_codegen.txt"), key=lambda p: p.stat().st_size)
  if not paths:
    raise FileNotFoundError(f"no *after_codegen.txt under {dump_dir}: set XLA_FLAGS=--xla_dump_to for the compile")
  with_kernel = [p for p in paths if 'custom_call_target="tpu_custom_call"' in p.read_text()]
  return (with_kernel or paths)[-1]


def parse_entry(path: str | pathlib.Path, kernel_names: list[str]) -> list[HloOp]:
  """Top-level ops of the ENTRY computation of `path`, matching each tpu_custom_call to a kernel.

  `kernel_names`: the Mosaic kernel function names of the compile, in dump order; a custom call
  gets the first not yet used name that its serialized body contains.

  Raises:
    ValueError: no ENTRY computation, or a tpu_custom_call whose kernel is not among kernel_names.
  """
  text = pathlib.Path(path).read_text()
  start = re.search(r"^ENTRY\s", text, re.M)
  if not start:
    raise ValueError(f"{path}: no ENTRY computation")
  lines = text[start.end():].split("\n")
  ops: list[HloOp] = []
  unused = list(kernel_names)
  for line in lines[1:]:
    if line.startswith("}"):
      break
    m = _INSTR_RE.match(line)
    if not m:
      continue
    name, rhs = m.group(1), m.group(2)
    head = re.sub(r'metadata=\{.*', "", rhs)
    # The result shape precedes the opcode: `TYPE opcode(` or `(TYPE, TYPE) opcode(`.
    om = re.search(r"(?:\)|\})\s+([a-z][\w\-]*)\(", head) or re.search(r"\s([a-z][\w\-]*)\(", head)
    opcode = om.group(1) if om else "unknown"
    result = head[:om.start(1)] if om else head
    cyc = re.search(r'"estimated_cycles":"(\d+)"', rhs)
    op = HloOp(name.lstrip("%"), opcode, _shape_bytes(result), int(cyc.group(1)) if cyc else None)
    if 'custom_call_target="tpu_custom_call"' in rhs:
      body = re.search(r'"body":"([^"]*)"', rhs)
      blob = base64.b64decode(body.group(1) + "=" * (-len(body.group(1)) % 4)) if body else b""
      hit = next((k for k in unused if k.encode() in blob), None)
      if hit is None:
        raise ValueError(f"{path}: custom call {op.name} runs none of the dumped kernels {kernel_names}")
      unused.remove(hit)
      op.kernel = hit
    ops.append(op)
  return ops
