"""Device mesh, logical-axis sharding and multi-host start-up, mapping the config onto JAX's and
Flax NNX's own machinery in the manner of MaxText.

- Mesh: axes `data`, `fsdp`, `expert`, `tensor` (outermost first), sized by the
  `ici_*_parallelism` keys (-1 = the devices left). `jax.make_mesh` puts `tensor` on the fastest
  links; across hosts devices are ordered by process, so `data` is the axis that crosses hosts.
- Logical axes: the model names every parameter and activation axis (`model/nn/layers.py`); the
  config's `logical_axis_rules` (`"logical:mesh+mesh"`) map names to mesh axes, a name left out is
  replicated.
- KDA per shard: the KDA mixer calls its kernels through `per_shard` (`jax.shard_map`) on its own
  batch rows and heads. KDA heads never exchange data, so no collective is needed, and a Pallas
  kernel, which GSPMD cannot partition, runs on a sharded model. Everything else is GSPMD's.
- Multi-host: `initialize_distributed(cfg)` calls `jax.distributed.initialize` when
  `distributed_init=true`; it must run in every process before anything touches a device.

This module imports no model and no checkpoint code (building on a mesh is `model/loading.py`'s)::

    initialize_distributed(cfg)                  # no-op unless distributed_init=true
    mesh = create_mesh(cfg)                      # ConfigError on an impossible mesh
    model = loading.create(cfg, mesh)
    with mesh_context(mesh, cfg):                # jax.set_mesh + nnx.logical_axis_rules
      step = jax.jit(train_step, in_shardings=..., out_shardings=...)

Trace model code inside `mesh_context`; outside a mesh every hook is the identity.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from configs import base
from model.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "tensor")
PARALLELISM_KEYS = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism",
                    "expert": "ici_expert_parallelism", "tensor": "ici_tensor_parallelism"}
DCN_PARALLELISM_KEYS = {"data": "dcn_data_parallelism", "fsdp": "dcn_fsdp_parallelism",
                        "expert": "dcn_expert_parallelism", "tensor": "dcn_tensor_parallelism"}
# Every logical axis name the model uses (parameters: model/nn/layers.py; activations: this module).
PARAM_AXES = ("embed", "heads", "kv", "mlp", "expert", "vocab")
ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed", "activation_heads",
                   "activation_vocab")
LOGICAL_AXES = ACTIVATION_AXES + PARAM_AXES

# Logical axes of activations and caches, shared by the model hooks and the helpers below.
BATCH_TOKENS = ("activation_batch", "activation_length")                         # ids, segment_ids [B, T]
HIDDEN = ("activation_batch", "activation_length", "activation_embed")          # [B, T, d]
LOGITS = ("activation_batch", "activation_length", "activation_vocab")          # [B, T, V]
DECODE_HIDDEN = ("activation_batch", "activation_embed")                        # [S, d]
DECODE_LOGITS = ("activation_batch", "activation_vocab")                        # [S, V]
HEADS_BTHK = ("activation_batch", "activation_length", "activation_heads", None)  # q, k, v, g, o
HEADS_BTH = ("activation_batch", "activation_length", "activation_heads")       # beta
STATE_BNHKV = ("activation_batch", None, "activation_heads", None, None)        # per-slot KDA states
HEADS_SHK = ("activation_batch", "activation_heads", None)                      # decode q, k, v, g
HEADS_SH = ("activation_batch", "activation_heads")                             # decode beta
STATE_SHKV = ("activation_batch", "activation_heads", None, None)               # decode KDA state
HEAD_PARAM = ("activation_heads",)                                              # A_log [H], dt_bias [H*K]

Rules = tuple[tuple[str, "str | tuple[str, ...] | None"], ...]
_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([A-Za-z_+\s]*)$")


# ---------------------------------------------------------------------------------------------
# Config: rules, mesh shape, validation
# ---------------------------------------------------------------------------------------------
def parse_logical_axis_rules(items: Sequence[str]) -> Rules:
  """Parses `logical_axis_rules` strings into Flax's rule format.

  Args:
    items: strings `"logical:axis+axis"` (`"logical:"` or `"logical:none"` = replicated), e.g.
      `["activation_batch:data+fsdp", "heads:tensor", "kv:"]`.

  Returns:
    `((logical, mesh_axes), ...)` for every name of `LOGICAL_AXES`, in that order; `mesh_axes` is
    None (replicated), one axis name, or a tuple of names (the dimension is split over their
    product, first name outermost). Names not listed map to None.

  Raises:
    ConfigError: a malformed rule, an unknown logical or mesh axis name, a name given twice, or a
      mesh axis used twice in one rule.
  """
  if isinstance(items, str) or not isinstance(items, Sequence):
    raise ConfigError(f"logical_axis_rules must be a list of 'logical:axis+axis' strings, got {items!r}")
  found: dict[str, str | tuple[str, ...] | None] = {}
  for item in items:
    m = _RULE.match(item) if isinstance(item, str) else None
    if m is None:
      raise ConfigError(f"logical_axis_rules entry {item!r} must be written 'logical:axis+axis' "
                        f"(mesh axes {list(MESH_AXES)}; 'logical:' replicates)")
    name, rhs = m.group(1), m.group(2).strip()
    if name not in LOGICAL_AXES:
      raise ConfigError(f"logical_axis_rules names unknown logical axis {name!r}; known: {list(LOGICAL_AXES)}")
    if name in found:
      raise ConfigError(f"logical_axis_rules gives logical axis {name!r} more than once")
    axes = tuple(a.strip() for a in rhs.split("+")) if rhs and rhs.lower() != "none" else ()
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
      raise ConfigError(f"logical_axis_rules entry {item!r} names unknown mesh axes {bad}; "
                        f"mesh axes are {list(MESH_AXES)}")
    if len(set(axes)) != len(axes):
      raise ConfigError(f"logical_axis_rules entry {item!r} uses a mesh axis twice")
    found[name] = None if not axes else axes[0] if len(axes) == 1 else axes
  return tuple((name, found.get(name)) for name in LOGICAL_AXES)


def rules_from_config(cfg) -> Rules:
  """`parse_logical_axis_rules(cfg.logical_axis_rules)`."""
  return parse_logical_axis_rules(list(cfg.logical_axis_rules))


def _axes_of(rules: Rules, logical: str) -> tuple[str, ...]:
  value = dict(rules).get(logical)
  return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def _check_model_divisibility(cfg, sizes: dict[str, int], rules: Rules) -> None:
  """Head and expert counts against the mesh axes they are split over (sizes may hold -1: skipped)."""
  def split(logical):
    axes = _axes_of(rules, logical)
    if any(sizes[a] == -1 for a in axes):
      return None, axes
    return math.prod(sizes[a] for a in axes), axes

  for logical in ("heads", "activation_heads"):
    n, axes = split(logical)
    if n is None or n == 1:
      continue
    for key in ("kda_num_heads", "num_attention_heads"):
      if cfg[key] % n:
        raise ConfigError(
            f"{key}={cfg[key]} is not divisible by {n}, the size of the mesh axes {'x'.join(axes)} that "
            f"logical axis {logical!r} is split over ({_sizes_text(sizes, axes)}); each device must hold "
            f"whole heads: change ici_tensor_parallelism or logical_axis_rules")
  n, axes = split("expert")
  if n is not None and n > 1 and cfg.num_experts % n:
    raise ConfigError(
        f"num_experts={cfg.num_experts} is not divisible by {n}, the size of the mesh axes {'x'.join(axes)} "
        f"that logical axis 'expert' is split over ({_sizes_text(sizes, axes)}): change "
        f"ici_expert_parallelism or logical_axis_rules")


def _sizes_text(sizes, axes) -> str:
  return ", ".join(f"{PARALLELISM_KEYS[a]}={sizes[a]}" for a in axes)


def _check_moe_impl(cfg, sizes: dict[str, int]) -> None:
  """An explicit `moe_impl=megablox` on a mesh of more than one device (sizes may hold -1: the known
  axes decide). Its Pallas TPU grouped matmul runs on whole arrays and GSPMD cannot split a Pallas
  kernel: the compile would fail deep inside Mosaic ("cannot be automatically partitioned"). `auto`
  picks dense there (model/nn/moe.py `resolve_moe_impl`)."""
  if getattr(cfg, "moe_impl", None) != "megablox":
    return
  split = {a: v for a, v in sizes.items() if v > 1}
  if split:
    keys = []
    for axis, size in split.items():
      ici, dcn = cfg[PARALLELISM_KEYS[axis]], cfg[DCN_PARALLELISM_KEYS[axis]]
      if ici != 1:
        keys.append(f"{PARALLELISM_KEYS[axis]}=-1 (the devices left: {size // dcn})" if ici == -1
                    else f"{PARALLELISM_KEYS[axis]}={ici}")
      if dcn > 1:
        keys.append(f"{DCN_PARALLELISM_KEYS[axis]}={dcn}")
    least = "at least " if -1 in sizes.values() else ""
    raise ConfigError(f"moe_impl=megablox needs one device: its Pallas TPU grouped matmul cannot be split over a "
                      f"mesh, and this job's mesh has {least}{math.prod(split.values())} devices "
                      f"({', '.join(keys)}); use moe_impl=auto (dense on a mesh), dense or ragged, or set those "
                      f"keys to 1")


def _raw_sizes(cfg) -> dict[str, int]:
  sizes = {}
  for axis, key in PARALLELISM_KEYS.items():
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
      raise ConfigError(f"{key} must be a positive int or -1 (every device left), got {value!r}")
    sizes[axis] = value
  auto = [PARALLELISM_KEYS[a] for a, v in sizes.items() if v == -1]
  if len(auto) > 1:
    raise ConfigError(f"at most one mesh axis may be -1 (the devices left), got {auto}")
  return sizes


def dcn_sizes(cfg) -> dict[str, int]:
  """The four `dcn_*_parallelism` sizes (mesh axes split across slices; product = number of slices).

  Raises:
    ConfigError: a size that is not an int >= 1.
  """
  sizes = {}
  for axis, key in DCN_PARALLELISM_KEYS.items():
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f"{key} must be an int >= 1 (mesh axis size across slices), got {value!r}")
    sizes[axis] = value
  return sizes


def _times_dcn(cfg, sizes: dict[str, int]) -> dict[str, int]:
  dcn = dcn_sizes(cfg)
  return {a: (v if v == -1 else v * dcn[a]) for a, v in sizes.items()}


def validate_mesh_config(cfg, num_devices: int | None = None) -> None:
  """Checks the mesh and sharding keys; `model.config.validate_config` calls it with no devices.

  Without `num_devices` only what the config alone decides is checked (sizes, rules, head and
  expert counts against the explicitly sized axes, `moe_impl=megablox` on explicit axes of more than
  one device); with it, the -1 axis is resolved and the product checked against the devices too.

  Raises:
    ConfigError: naming the key(s) and what was expected.
  """
  sizes = _times_dcn(cfg, _raw_sizes(cfg))
  rules = rules_from_config(cfg)
  for key in ("num_processes", "process_id"):
    if cfg[key] < -1:
      raise ConfigError(f"{key} must be >= 0 or -1 (auto-detect), got {cfg[key]}")
  if cfg.num_processes > 0 and cfg.process_id >= cfg.num_processes:
    raise ConfigError(f"process_id={cfg.process_id} must be < num_processes={cfg.num_processes}")
  if num_devices is not None:
    sizes = mesh_shape(cfg, num_devices)
  _check_model_divisibility(cfg, sizes, rules)
  _check_moe_impl(cfg, sizes)


def mesh_shape(cfg, num_devices: int) -> dict[str, int]:
  """Resolves the four `ici_*_parallelism` keys against `num_devices` (times the `dcn_*` sizes).

  With `dcn_*_parallelism` sizes multiplying to D slices, the `ici_*` sizes describe one slice of
  `num_devices / D` devices and each returned size is ici x dcn.

  Returns:
    `{"data": n, "fsdp": n, "expert": n, "tensor": n}` whose product is `num_devices`.

  Raises:
    ConfigError: sizes whose product does not equal (or, with a -1, does not divide)
      `num_devices`, dcn sizes that do not divide it, head/expert counts not divisible by
      their mesh axes, or `moe_impl=megablox` on more than one device (a Pallas kernel GSPMD
      cannot split).
  """
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
  dcn = dcn_sizes(cfg)
  slices = math.prod(dcn.values())
  if num_devices % slices:
    raise ConfigError(f"the dcn_*_parallelism sizes multiply to {slices} slices, which does not divide the "
                      f"{num_devices} devices")
  full = _resolve_ici(cfg, num_devices // slices)
  sizes = {a: full[a] * dcn[a] for a in MESH_AXES}
  _check_model_divisibility(cfg, sizes, rules_from_config(cfg))
  _check_moe_impl(cfg, sizes)
  return sizes


def ici_mesh_shape(cfg, num_devices: int) -> dict[str, int]:
  """The per-slice (`ici_*`) sizes of `mesh_shape(cfg, num_devices)` (equal to it on one slice)."""
  full = mesh_shape(cfg, num_devices)
  dcn = dcn_sizes(cfg)
  return {a: full[a] // dcn[a] for a in MESH_AXES}


def _resolve_ici(cfg, num_devices: int) -> dict[str, int]:
  sizes = _raw_sizes(cfg)
  fixed = math.prod(v for v in sizes.values() if v != -1)
  text = ", ".join(f"{PARALLELISM_KEYS[a]}={v}" for a, v in sizes.items())
  if -1 in sizes.values():
    if num_devices % fixed:
      raise ConfigError(f"the mesh axes of fixed size ({text}) multiply to {fixed}, which does not divide "
                        f"the {num_devices} devices, so no size fits the -1 axis")
    sizes = {a: (num_devices // fixed if v == -1 else v) for a, v in sizes.items()}
  elif fixed != num_devices:
    raise ConfigError(f"the mesh axes ({text}) multiply to {fixed} but there are {num_devices} devices"
                      f"{' per slice' if math.prod(dcn_sizes(cfg).values()) > 1 else ''}; "
                      f"make the product equal the device count or set one axis to -1")
  return sizes


def create_mesh(cfg, devices: Sequence | None = None) -> Mesh:
  """The device mesh described by the config (axes `MESH_AXES`, every axis `AxisType.Auto`).

  Args:
    cfg: a config from `model.config.load_config`.
    devices: the devices to lay out; default `jax.devices()` (every process's devices).

  Returns:
    A `jax.sharding.Mesh` from `jax.make_mesh` (physical-topology aware on TPU). When an axis size
    is not a product of whole physical axes of the TPU torus (e.g. tensor=8 on a 4x4 slice), the
    physical axes are split to lay it out (`allow_split_physical_axes`, as MaxText's key of that
    name allows) and a `UserWarning` says so: collectives over a split axis may cross more links.

  Raises:
    ConfigError: an impossible mesh (see `mesh_shape`).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  dcn = dcn_sizes(cfg)
  if math.prod(dcn.values()) > 1:
    # Multi-slice: each slice's devices form the ici mesh, slices are tiled along the dcn axes.
    from jax.experimental import mesh_utils
    ici = tuple(sizes[a] // dcn[a] for a in MESH_AXES)
    grid = mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn[a] for a in MESH_AXES), devices,
                                                allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
  # Auto axes: GSPMD propagates shardings from the annotated inputs, parameters and constraints.
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
  except NotImplementedError:   # jax's torus assignment: an axis is not a product of whole physical axes
    from jax.experimental import mesh_utils  # device-layout helpers: needed only when make_mesh refuses the layout
    warnings.warn(f"mesh ({_sizes_text(sizes, MESH_AXES)}): an axis size is not a product of whole physical "
                  f"axes of the device torus; splitting physical axes to lay it out (collectives over a split "
                  f"axis may cross more links)", UserWarning, stacklevel=2)
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def job_mesh(cfg, devices: Sequence | None = None) -> Mesh | None:
  """The mesh of a job: `create_mesh(cfg, devices)` on several devices, None on one device (nothing
  to shard), where the `ici_*_parallelism` keys are still checked: their product must be 1 (a -1
  axis takes the rest), so `ici_data_parallelism=2` on one device is an error, not ignored.

  Raises:
    ConfigError: an impossible mesh (see `mesh_shape`).
  """
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) == 1:
    mesh_shape(cfg, 1)
    return None
  return create_mesh(cfg, devices)


def as_rules(rules_or_cfg) -> Rules:
  """Parsed rules from a config (its `logical_axis_rules`), already parsed rules, or None (the
  base defaults)."""
  if rules_or_cfg is None:
    return default_rules()
  if hasattr(rules_or_cfg, "logical_axis_rules"):
    return rules_from_config(rules_or_cfg)
  return tuple(rules_or_cfg)


def default_rules() -> Rules:
  """The rules of `configs/base.py`."""
  return parse_logical_axis_rules(list(base.get_config().logical_axis_rules))


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules_or_cfg=None):
  """`jax.set_mesh(mesh)` and `nnx.logical_axis_rules(rules)` together.

  Trace (jit) and run the model inside it: the KDA kernels then run per shard and the logical
  activation constraints apply. `rules_or_cfg`: a config, parsed rules, or None (base defaults).
  """
  rules = as_rules(rules_or_cfg)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    yield mesh


# ---------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec
# ---------------------------------------------------------------------------------------------
def current_rules() -> Rules:
  """The rules of the enclosing `mesh_context` (`nnx.logical_axis_rules`), else the base defaults, as
  nested tuples (hashable: a jit's static argument can carry them)."""
  rules = flax_spmd.get_logical_axis_rules()
  if not rules:
    return default_rules()
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules | None = None) -> P:
  """`PartitionSpec` of an array whose dimensions carry `logical_axes` (None = replicated).

  Raises:
    ValueError: a logical name with no rule and not in `LOGICAL_AXES`.
  """
  table = dict(current_rules() if rules is None else rules)
  out = []
  for name in logical_axes:
    if name is None:
      out.append(None)
    elif name in table:
      out.append(table[name])
    elif name in LOGICAL_AXES:
      out.append(None)
    else:
      raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
  return P(*out)


def _active_mesh():
  """The context mesh when it has more than one device, else None (every hook is then a no-op)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return None
  return mesh


def _spec_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _undividable(spec: P, shape: Sequence[int], mesh) -> set[str]:
  """Mesh axes to drop so that every split dimension of `shape` divides evenly.

  Keeps, per dimension, the longest prefix of its mesh axes whose product divides the dimension
  (e.g. a batch of 2 on data=2 x fsdp=2 stays split on data only)."""
  drop: set[str] = set()
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    prod = 1
    for i, axis in enumerate(_spec_axes(entry)):
      prod *= mesh.shape[axis]
      if dim % prod:
        drop.update(_spec_axes(entry)[i:])
        break
  return drop


def _without(spec: P, drop: set[str]) -> P:
  out = []
  for entry in spec:
    kept = tuple(a for a in _spec_axes(entry) if a not in drop)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return P(*out)


def fitted_spec(logical_axes, shape, mesh, rules: Rules | None = None) -> P:
  """`logical_to_spec`, minus mesh axes that do not divide their dimension of `shape` (replicated
  there instead), so that e.g. a batch of 1 runs on a data-parallel mesh."""
  spec = logical_to_spec(logical_axes, rules)
  return _without(spec, _undividable(spec, shape, mesh))


def constrain(x, logical_axes):
  """`jax.lax.with_sharding_constraint(x, spec of logical_axes)` inside a multi-device mesh
  context; `x` unchanged otherwise. Undividable dimensions are left replicated (`fitted_spec`)."""
  mesh = _active_mesh()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, fitted_spec(logical_axes, x.shape, mesh))


def per_shard(fn: Callable, args: Sequence, in_axes: Sequence, out_axes: Sequence):
  """Runs `fn(*args)` on each device's shard under `jax.shard_map` (identity wrapper off-mesh).

  Used by the KDA mixer so that a kernel runs on its device's batch rows and heads only: KDA heads
  are independent, so no collective is needed, and a Pallas kernel (which GSPMD cannot split) works
  on a sharded model. The same mesh axes are dropped from every spec when one does not divide its
  dimension (e.g. a batch of 1 on a data-parallel mesh): that dimension is then replicated.

  Args:
    fn: positional function of `args`, returning a tuple of arrays (one per `out_axes` entry).
    args: arrays (or None, passed through as None) with global shapes.
    in_axes / out_axes: logical axes per argument / per output (e.g. `HEADS_BTHK`).

  Returns:
    The tuple of global outputs.
  """
  mesh = _active_mesh()
  if mesh is None:
    return tuple(fn(*args))
  rules = current_rules()
  present = [i for i, a in enumerate(args) if a is not None]
  in_specs = [logical_to_spec(in_axes[i], rules) for i in present]
  drop = set().union(*[_undividable(s, args[i].shape, mesh) for s, i in zip(in_specs, present)])
  in_specs = tuple(_without(s, drop) for s in in_specs)
  out_specs = tuple(_without(logical_to_spec(a, rules), drop) for a in out_axes)

  def local(*xs):
    full = [None] * len(args)
    for i, x in zip(present, xs):
      full[i] = x
    return tuple(fn(*full))

  # check_vma=False: backend kernels (scans seeded with zeros, Pallas calls) are written for plain
  # arrays, not for JAX's varying-manual-axes typing. Correct here because every output is split on
  # the same batch/head axes as the inputs it depends on; for axes an input does not mention (it is
  # replicated there), shard_map's transpose sums the cotangent over them.
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*[args[i] for i in present])


# ---------------------------------------------------------------------------------------------
# Parameters: shardings of an abstract state, placement
# ---------------------------------------------------------------------------------------------
def _var_name(path) -> str:
  return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def param_shardings(abs_state, mesh: Mesh):
  """`NamedSharding` per variable of an abstract `nnx.State` (logical axes -> mesh axes by the rules of
  the enclosing `mesh_context`).

  Raises:
    ConfigError: a parameter annotated with a logical axis that has no rule, or a dimension not
      divisible by the mesh axes it is mapped to (naming the parameter and the keys to change).
  """
  specs = nnx.get_partition_spec(abs_state)

  def check(path, leaf, spec):
    for dim, entry in zip(leaf.shape, tuple(spec)):
      axes = _spec_axes(entry)
      bad = [a for a in axes if a not in mesh.shape]
      if bad:
        raise ConfigError(f"parameter {_var_name(path)} is annotated with logical axis {bad[0]!r}, which has no "
                          f"rule in logical_axis_rules (known logical axes: {list(LOGICAL_AXES)})")
      n = math.prod(mesh.shape[a] for a in axes)
      if dim % n:
        raise ConfigError(f"parameter {_var_name(path)} of shape {tuple(leaf.shape)} cannot be split: a dimension "
                          f"of size {dim} is mapped to mesh axes {'x'.join(axes)} of size {n}; change the "
                          f"ici_*_parallelism keys or logical_axis_rules")
    return NamedSharding(mesh, spec)

  return jax.tree.map_with_path(check, abs_state, specs)


def state_shardings(state):
  """The `NamedSharding` tree of an abstract state from `abstract_state` (for jit in/out shardings)."""
  return jax.tree.map(lambda a: a.sharding, state)


def replicate_off_mesh(tree, mesh: Mesh):
  """Replicates on `mesh` every array leaf of `tree` that does not live on all its devices (e.g. the
  scalar step, PRNG key and optimizer count of a train state), leaving sharded leaves alone: one
  jitted program cannot mix arrays committed to one device with arrays on the mesh."""
  devices = set(np.asarray(mesh.devices).flat)
  replicated = NamedSharding(mesh, P())

  def place(x):
    if isinstance(x, jax.Array) and set(x.sharding.device_set) != devices:
      return jax.device_put(x, replicated)
    return x

  return jax.tree.map(place, tree)


# ---------------------------------------------------------------------------------------------
# Batches and caches
# ---------------------------------------------------------------------------------------------
def batch_sharding(mesh: Mesh, shape: Sequence[int], logical_axes=BATCH_TOKENS, rules_or_cfg=None) -> NamedSharding:
  """Sharding of a batch array (default `[B, T]` ids / segment ids: rows on `activation_batch`),
  replicated along any mesh axis that does not divide its dimension."""
  rules = as_rules(rules_or_cfg)
  axes = tuple(logical_axes)[:len(shape)] + (None,) * max(0, len(shape) - len(logical_axes))
  return NamedSharding(mesh, fitted_spec(axes, shape, mesh, rules))


def process_rows(mesh: Mesh, shape: Sequence[int], logical_axes=BATCH_TOKENS, rules_or_cfg=None) -> slice:
  """The rows (leading dimension) of a global batch array of `shape` that this process's devices
  hold under `batch_sharding`: the part of the batch this process must build.

  On one process, or when the batch axes do not divide the rows (replicated), `slice(0, shape[0])`.
  With the `data` axis across hosts (`create_mesh` orders devices by process), process p of P gets
  rows `[p * B / P, (p + 1) * B / P)`.

  Raises:
    ConfigError: this process's devices hold rows that are not one contiguous range (a mesh whose
      batch axes interleave processes), which `global_batch` cannot assemble from one local block.
  """
  shape = tuple(int(d) for d in shape)
  index = batch_sharding(mesh, shape, logical_axes, rules_or_cfg).addressable_devices_indices_map(shape)
  ranges = sorted({(sl[0].start or 0, shape[0] if sl[0].stop is None else sl[0].stop) for sl in index.values()})
  for (_, stop), (start, _) in zip(ranges, ranges[1:]):
    if start != stop:
      raise ConfigError(f"process {jax.process_index()} holds batch rows {ranges}, not one contiguous range: lay "
                       f"the batch mesh axes out so that each process's devices are adjacent along them")
  return slice(ranges[0][0], ranges[-1][1])


def global_batch(local, mesh: Mesh, shape: Sequence[int], logical_axes=BATCH_TOKENS, rules_or_cfg=None) -> jax.Array:
  """The global `[B, ...]` array of `shape`, sharded by `batch_sharding`, from this process's rows.

  Args:
    local: this process's rows `process_rows(mesh, shape, ...)` of the global batch (NumPy; on one
      process, the whole batch). Every process passes its own slice; none builds the whole batch.
    mesh, shape, logical_axes, rules_or_cfg: as `batch_sharding`; `shape` is the global shape.

  Returns:
    A `jax.Array` of `shape` (`jax.make_array_from_process_local_data`: each device gets its rows
    from the local block, no cross-host transfer).

  Raises:
    ValueError: `local` is not the size of this process's rows. ConfigError: as `process_rows`.
  """
  shape = tuple(int(d) for d in shape)
  local = np.asarray(local)
  rows = process_rows(mesh, shape, logical_axes, rules_or_cfg)
  want = (rows.stop - rows.start,) + shape[1:]
  if local.shape != want:
    raise ValueError(f"global_batch: local rows have shape {local.shape}, expected {want} (rows {rows.start}:"
                     f"{rows.stop} of the global {shape})")
  return jax.make_array_from_process_local_data(batch_sharding(mesh, shape, logical_axes, rules_or_cfg), local,
                                                shape)


def tree_shardings(tree, axes_tree, mesh: Mesh, rules_or_cfg=None):
  """`NamedSharding` per leaf of `tree` (arrays or `ShapeDtypeStruct`s) from `axes_tree`, a tree of
  the same structure whose leaves are tuples of logical axis names; a mesh axis that does not divide
  its dimension is dropped (that dimension stays replicated along it)."""
  rules = as_rules(rules_or_cfg)
  is_axes = lambda x: isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)
  flat_axes = jax.tree.leaves(axes_tree, is_leaf=is_axes)
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [NamedSharding(mesh, fitted_spec(a, x.shape, mesh, rules))
                                      for a, x in zip(flat_axes, leaves)])


# ---------------------------------------------------------------------------------------------
# Multi-host start-up
# ---------------------------------------------------------------------------------------------
def initialize_distributed(cfg) -> bool:
  """Starts JAX's multi-process runtime when `cfg.distributed_init` is true.

  Call it first thing in every process of a multi-host job (before anything touches a device:
  afterwards `jax.devices()` lists every process's devices and `create_mesh` spans them all). Empty
  `coordinator_address` and -1 `num_processes` / `process_id` leave them to
  `jax.distributed.initialize`'s cluster auto-detection (Cloud TPU, SLURM, Open MPI, ...); on a
  plain cluster give all three (the same coordinator "host:port" of process 0 everywhere).
  Safe to call twice (the second call does nothing).

  Returns:
    True when this call initialised the runtime, False when it was off or already running.
  """
  if not cfg.distributed_init:
    return False
  if jax.distributed.is_initialized():
    return False
  kwargs = {}
  if cfg.coordinator_address:
    kwargs["coordinator_address"] = cfg.coordinator_address
  if cfg.num_processes >= 0:
    kwargs["num_processes"] = cfg.num_processes
  if cfg.process_id >= 0:
    kwargs["process_id"] = cfg.process_id
  jax.distributed.initialize(**kwargs)
  return True


def describe_mesh(mesh: Mesh) -> str:
  """One line for logs, e.g. `mesh data=2 fsdp=2 expert=1 tensor=2 (8 devices, 1 process)`."""
  axes = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
  procs = len({d.process_index for d in np.asarray(mesh.devices).flat})
  return f"mesh {axes} ({mesh.size} devices, {procs} process{'es' if procs > 1 else ''})"
