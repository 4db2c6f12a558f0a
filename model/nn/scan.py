"""Scan over repeated groups of decoder layers, and rematerialisation policies (config keys
`scan_layers`, `remat_policy`, as MaxText's).

`scan_plan` finds the longest stretch of identical consecutive layer groups (at least two): in
Kimi-Linear-48B, layers 2-25 are six copies of (KDA, KDA, MLA, KDA), all MoE (layer 1's dense FFN
shifts the period by one). `run_layers` runs them as one `jax.lax.scan` over the group, so compile
time and program size stop growing with depth; the other layers run unrolled.

Parameters stay per layer (the Hugging Face names), so checkpoints, conversion, resume and the
optimizer state are unchanged; the scan stacks them inside the traced function, which XLA
materialises as a second copy. A caller holding them already stacked (`split_stacked` outside the
program) runs inside `prestacked_groups(stacked)` and nothing is stacked in the trace. Either way
the result equals the unrolled model's (tests/model/test_scan_layers.py).

`remat_policy` (mode "train"; jax.checkpoint around each scanned group and unrolled layer): "none"
(keep every activation), "full" (`nothing_saveable`, also accepted under that name: keep only layer
inputs; the shipped default, configs/base.py), "minimal" (`checkpoint_dots_with_no_batch_dims`: keep
matmuls against parameters), "dots_saveable" (keep every matmul result). Unrolled layers are
checkpointed with `prevent_cse=True`: without it XLA merges the recomputation into the forward pass
and the policy saves nothing (docs/performance.md, "Training memory on v5e:1x1 (compiled ahead of
time)").
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import REMAT_POLICY_NAMES

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}
assert tuple(REMAT_POLICIES) == REMAT_POLICY_NAMES


def scan_plan(signatures: Sequence) -> tuple[int, int, int] | None:
  """`(start, period, repeats)`: the longest run of `repeats >= 2` identical consecutive groups of
  `period` layers from layer index `start` (0-indexed), by layers covered; ties go to the earliest
  start, then the shortest period. None when no group repeats.

  Args:
    signatures: one hashable per layer, equal for layers of the same structure (mixer kind, FFN kind).
  """
  n = len(signatures)
  best = None
  for period in range(1, n // 2 + 1):
    for start in range(n - 2 * period + 1):
      block = tuple(signatures[start:start + period])
      repeats = 1
      while tuple(signatures[start + repeats * period:start + (repeats + 1) * period]) == block:
        repeats += 1
      if repeats >= 2:
        key = (repeats * period, -start, -period)
        if best is None or key > best[0]:
          best = (key, (start, period, repeats))
  return None if best is None else best[1]


def _routing_blocks(module):
  return [m for _, m in nnx.iter_modules(module) if getattr(m, "record_routing", False)]


def _checkpointed(fn: Callable, policy_name: str, train: bool, *, in_scan: bool) -> Callable:
  """`fn` under `jax.checkpoint` with the named policy (unchanged when not `train` or policy "none").

  `prevent_cse` is off only for the scan body (`in_scan`), where jax's docs say it is safe: for an
  unrolled layer XLA would otherwise merge the backward pass's recomputation with the forward (common
  subexpressions) and keep every activation anyway, making the policy a no-op.
  """
  if not train or REMAT_POLICIES[policy_name] is None:
    return fn
  return jax.checkpoint(fn, policy=REMAT_POLICIES[policy_name], prevent_cse=not in_scan)


def _pure(graphdefs, step, constrain):
  """`(states, x, caches) -> (x, new caches, routed_experts per layer or None)` over one group."""
  def fn(states, x, caches):
    news, routed = [], []
    for gdef, st, c in zip(graphdefs, states, caches):
      layer = nnx.merge(gdef, st)
      blocks = _routing_blocks(layer)
      if blocks:  # load balancing: the group's routing, handed out of the scan (nnx.capture of sow)
        (x, new), inter = nnx.capture(lambda m, x_, c_: step(m, x_, c_), nnx.Intermediate)(layer, x, c)
        flat = [v.get_value() for _, v in nnx.to_flat_state(inter)]
        routed.append(flat[0][0] if flat else None)
      else:
        x, new = step(layer, x, c)
        routed.append(None)
      x = constrain(x)
      news.append(new)
    return x, news, routed
  return fn


def run_layers(layers, x, caches, step: Callable, constrain: Callable, *, plan, remat_policy: str,
               train: bool):
  """Runs `layers` in order on `x`: `step(layer, x, cache) -> (x, new cache)`, `constrain(x)` after
  each layer; layers `[start, start + period * repeats)` of `plan` (`scan_plan`, or None: all
  unrolled) as one `jax.lax.scan` over their groups.

  Args:
    layers: the decoder layers (nnx modules). caches: one incoming cache per layer (None entries allowed).
    remat_policy: a key of `REMAT_POLICIES`, applied when `train`.

  Returns:
    `(x, [new cache per layer])`. MoE blocks recording their routing (`record_routing`) get it sown
    on the model's own modules, as unrolled layers do.
  """
  n = len(layers)
  start, period, repeats = plan if plan is not None else (n, 0, 0)
  news = [None] * n
  use_pure = train and REMAT_POLICIES[remat_policy] is not None

  def unrolled(i, x):
    layer = layers[i]
    if not use_pure:
      x, news[i] = step(layer, x, caches[i])
      return constrain(x)
    gdef, st = nnx.split(layer)
    fn = _checkpointed(_pure([gdef], step, constrain), remat_policy, train, in_scan=False)
    x, (news[i],), (routed,) = fn([st], x, [caches[i]])
    _sow_routed(layer, routed)
    return x

  for i in range(start):
    x = unrolled(i, x)
  if repeats:
    group = lambda g: [layers[start + g * period + j] for j in range(period)]
    splits = [[nnx.split(m) for m in group(g)] for g in range(repeats)]
    graphdefs = [gd for gd, _ in splits[0]]
    for g in range(1, repeats):
      if [gd for gd, _ in splits[g]] != graphdefs:
        raise AssertionError(f"scan_plan grouped layers of different structure (group {g} of {plan})")
    pre = _PRESTACKED.get()
    if pre is not None:
      _check_prestacked(pre, [st for _, st in splits[0]], repeats)
      stacked = list(pre)
    else:
      stacked = [jax.tree.map(lambda *a: jnp.stack(a), *[splits[g][j][1] for g in range(repeats)])
                 for j in range(period)]
    group_caches = [caches[start + j::period][:repeats] for j in range(period)]
    have_cache = [all(c is not None for c in cs) for cs in group_caches]
    xs_caches = [jax.tree.map(lambda *a: jnp.stack(a), *cs) if ok else None
                 for cs, ok in zip(group_caches, have_cache)]
    fn = _checkpointed(_pure(graphdefs, step, constrain), remat_policy, train, in_scan=True)

    def body(carry, xs):
      states, cs = xs
      y, new, routed = fn(states, carry, cs)
      return y, (new, routed)

    x, (new_stacked, routed_stacked) = jax.lax.scan(body, x, (stacked, xs_caches))
    for g in range(repeats):
      for j in range(period):
        i = start + g * period + j
        news[i] = jax.tree.map(lambda a: a[g], new_stacked[j])
        if routed_stacked[j] is not None:
          _sow_routed(layers[i], routed_stacked[j][g])
  for i in range(start + period * repeats, n):
    x = unrolled(i, x)
  return x, news


def _sow_routed(layer, routed):
  if routed is None:
    return
  for block in _routing_blocks(layer):
    block.sow(nnx.Intermediate, "routed_experts", routed)


# ------------------------------------------------------------------------------------------------
# Parameters stacked outside the program ("stack at load time")
# ------------------------------------------------------------------------------------------------

_PRESTACKED: contextvars.ContextVar = contextvars.ContextVar("prestacked_layer_groups", default=None)
LAYERS_PATH = ("model", "layers")  # where KimiLinearForCausalLM's state keeps its decoder layers


@contextlib.contextmanager
def prestacked_groups(stacked: Sequence):
  """Within the block (at trace time), `run_layers` scans over `stacked` instead of stacking.

  Args:
    stacked: one `nnx.State` per position j of the scanned group (`split_stacked`), each leaf
      `[repeats, *leaf shape]` (layer `start + g * period + j` at index g). Checked against the layers
      `run_layers` is given: a ValueError names the first mismatch.
  """
  token = _PRESTACKED.set(tuple(stacked))
  try:
    yield
  finally:
    _PRESTACKED.reset(token)


def _check_prestacked(pre, first_group_states, repeats: int) -> None:
  if len(pre) != len(first_group_states):
    raise ValueError(f"prestacked_groups got {len(pre)} stacked layer states for a scan group of "
                     f"{len(first_group_states)} layers")
  for j, (p, st) in enumerate(zip(pre, first_group_states)):
    if jax.tree.structure(p) != jax.tree.structure(st):
      raise ValueError(f"prestacked_groups: the stacked state of group position {j} is not shaped like its layers' "
                       f"state (different parameter tree)")
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(st)):
      if tuple(a.shape) != (repeats, *b.shape):
        raise ValueError(f"prestacked_groups: group position {j} has a stacked leaf of shape {tuple(a.shape)}, "
                         f"expected {(repeats, *b.shape)}")


def _scanned(plan) -> dict[int, tuple[int, int]]:
  start, period, repeats = plan
  return {start + g * period + j: (g, j) for g in range(repeats) for j in range(period)}


def split_stacked(state, plan, *, stack: Callable = lambda leaves: jnp.stack(leaves), prefix=LAYERS_PATH):
  """`(rest, stacked)`: the model `state` without the scanned layers, and their parameters stacked.

  Args:
    state: the model's `nnx.State` (`nnx.split(model)[1]`; arrays or `ShapeDtypeStruct`s).
    plan: the model's `scan_plan()` `(start, period, repeats)` (not None).
    stack: leaves of one group position (a list of `repeats` arrays) -> the stacked leaf; the
      default `jnp.stack` copies (do it once, at load time); `model.aot` passes one that builds a
      sharded `ShapeDtypeStruct`.
    prefix: the state path of the decoder layer list.

  Returns:
    rest: `nnx.State` of every other variable. stacked: one `nnx.State` per group position, as
    `prestacked_groups` takes it.
  """
  start, period, repeats = plan
  layers = state
  for key in prefix:
    layers = layers[key]
  stacked = [jax.tree.map(lambda *a: stack(list(a)), *[layers[start + g * period + j] for g in range(repeats)])
             for j in range(period)]
  scanned = _scanned(plan)
  n = len(prefix)
  rest = nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(state)
                              if not (tuple(p[:n]) == tuple(prefix) and p[n] in scanned)])
  return rest, stacked


def merge_stacked(rest, stacked, plan, *, prefix=LAYERS_PATH):
  """The full model state of `split_stacked`'s `(rest, stacked)`: layer i of the scan is row g of
  its position's stacked leaves (a slice: when the program runs under `prestacked_groups(stacked)`
  nothing reads it, so XLA drops it)."""
  items = list(nnx.to_flat_state(rest))
  for i, (g, j) in _scanned(plan).items():
    layer = jax.tree.map(lambda a, g=g: a[g], stacked[j])
    items += [((*prefix, i, *p), v) for p, v in nnx.to_flat_state(layer)]
  return nnx.from_flat_state(items)
