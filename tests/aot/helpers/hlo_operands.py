"""Reads a compiled HLO module's text: what produces each operand of a custom call.

Used to check that the KDA kernel (`custom_call_target="tpu_custom_call"`) reads q, k, v and g as
the model produced them: no `copy` or `transpose` (alone or as a fusion's work) between the
projection / short conv and the call. Bitcasts are free (same bytes) and are looked through.
"""

from __future__ import annotations

import dataclasses
import re

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r" ([a-z][a-z0-9_\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
RELAYOUT_OPCODES = ("copy", "transpose")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  operands: tuple[str, ...]
  computation: str
  text: str


def _operand_text(rest: str, opcode: str) -> str:
  start = rest.index(f" {opcode}(") + len(opcode) + 2
  depth = 1
  for i in range(start, len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    if depth == 0:
      return rest[start:i]
  raise ValueError(f"unbalanced operand list: {rest[:200]}")


def parse(hlo: str) -> tuple[dict[str, Instruction], dict[str, list[Instruction]]]:
  """`(instructions by name, instructions by computation name)` of an HLO module's text."""
  by_name, by_comp = {}, {}
  comp = None
  for line in hlo.splitlines():
    if not line.startswith(" "):
      m = _COMPUTATION.match(line)
      if m:
        comp = m.group(1)
        by_comp[comp] = []
      continue
    m = _DEF.match(line)
    if not m or comp is None:
      continue
    name, rest = m.groups()
    op = _OPCODE.search(rest)
    if not op:
      continue
    opcode = op.group(1)
    operands = tuple(re.findall(r"%([\w.\-]+)", _operand_text(rest, opcode)))
    inst = Instruction(name, opcode, operands, comp, line)
    by_name[name] = inst
    by_comp[comp].append(inst)
  return by_name, by_comp


def custom_calls(hlo: str, target: str = "tpu_custom_call") -> list[Instruction]:
  by_name, _ = parse(hlo)
  return [i for i in by_name.values() if i.opcode == "custom-call" and f'custom_call_target="{target}"' in i.text]


def operand_shapes(call: Instruction) -> list[tuple[str, tuple[int, ...]]]:
  """`(dtype, dims)` of each operand, from the call's `operand_layout_constraints`."""
  section = call.text.split("operand_layout_constraints={", 1)[1]
  shapes = [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(section)]
  return shapes[:len(call.operands)]


def producer(name: str, by_name: dict[str, Instruction]) -> Instruction:
  """The instruction that makes `name`'s bytes: `name`'s definition, looked through bitcasts."""
  inst = by_name[name]
  while inst.opcode == "bitcast":
    inst = by_name[inst.operands[0]]
  return inst


def relayouts(inst: Instruction, by_comp: dict[str, list[Instruction]]) -> list[str]:
  """The copy / transpose work `inst` does: itself, or (a fusion) any such op in its computation."""
  found = [inst.name] if inst.opcode in RELAYOUT_OPCODES else []
  if inst.opcode == "fusion":
    called = _CALLS.search(inst.text)
    body = by_comp.get(called.group(1), []) if called else []
    found += [f"{inst.name}/{i.name}" for i in body if i.opcode in RELAYOUT_OPCODES]
    if inst.name.startswith(RELAYOUT_OPCODES):  # XLA names a fusion after its root's work
      found.append(inst.name)
  return found
