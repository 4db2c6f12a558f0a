"""The one place that builds or restores a Kimi-Linear model, on one device or on a device mesh.

Every tool goes through here: `load(path, overrides)` for a checkpoint, `create(cfg)` for a random
initialisation. It sits above `model.nn`, `model.checkpoint` and `model.partitioning`, none of which
imports it, as MaxText's model creation sits above its sharding and checkpointing.

Before a model is allocated, `check_fits` refuses in one line a model larger than the memory that
will hold it (`model/memory.py`; `allow_large_model=true` builds it anyway). One load reads and
validates `DIR/config.json` once; pass `config=` when the caller already read it. On a mesh,
`abstract_state` gives `jax.ShapeDtypeStruct`s with their `NamedSharding`s: the target of a sharded
random init (born sharded) and of an Orbax restore (each device reads its own slices), whatever
mesh wrote the checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh

from model import memory, partitioning
from model.checkpoint import format as ckpt
from model.config import ModelArgs
from model.nn.kimi_linear import KimiLinearForCausalLM

read_config = ckpt.read_config  # the checkpoint's config + overrides, read and validated once


class Loaded(NamedTuple):
  """A model restored from a checkpoint: `model` (`KimiLinearForCausalLM`), its locked `config`,
  and the `mesh` its arrays live on (None: one device)."""

  model: KimiLinearForCausalLM
  config: object
  mesh: Mesh | None


def _args(cfg) -> ModelArgs:
  # Configs reach this module from load_config / read_config, which validated them already.
  return cfg if isinstance(cfg, ModelArgs) else ModelArgs.from_config(cfg, validate=False)


def _job_key(cfg, key: str, default):
  """A job key of `cfg` (configs/base.py MESH_KEYS' load keys); `default` for a bare ModelArgs."""
  get = getattr(cfg, "get", None)
  return default if get is None else get(key, default)


def check_fits(cfg, state, mesh: Mesh | None) -> None:
  """ModelTooLargeError (one line: parameter count and bytes against the device's memory, or the
  host's MemAvailable on CPU) when the abstract `state` would not fit where it is about to be built,
  unless `allow_large_model=true` in `cfg`. Runs before any parameter is allocated or read
  (`model.memory.check_parameters_fit`)."""
  devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
  name = _job_key(cfg, "model_name", None) or getattr(cfg, "model_name", "?")
  memory.check_parameters_fit(state, name=name, devices=devices,
                              allow=bool(_job_key(cfg, "allow_large_model", False)))


def abstract_model(config) -> KimiLinearForCausalLM:
  """The model of `config` with `jax.ShapeDtypeStruct` leaves (nothing allocated, no random init)."""
  args = _args(config)
  return nnx.eval_shape(lambda: KimiLinearForCausalLM(args, rngs=nnx.Rngs(0)))


def abstract_state(cfg, mesh: Mesh, rules_or_cfg=None):
  """The model's graph definition and its state as sharded `jax.ShapeDtypeStruct`s (no memory).

  Args:
    cfg: model config. mesh: the target mesh. rules_or_cfg: rules (default: `cfg`'s).

  Returns:
    `(graphdef, state)`: `state` is an `nnx.State` whose leaves are `ShapeDtypeStruct`s carrying
    their `NamedSharding`; a target for `jax.jit(out_shardings=...)` or an Orbax restore.

  Raises:
    ConfigError: a parameter dimension not divisible by its mesh axes, or an unmapped name.
  """
  rules = partitioning.as_rules(cfg if rules_or_cfg is None else rules_or_cfg)
  with partitioning.mesh_context(mesh, rules):
    graphdef, abs_state = nnx.split(abstract_model(cfg))
    shardings = partitioning.param_shardings(abs_state, mesh)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, shardings)
  return graphdef, state


def init_sharded(cfg, mesh: Mesh, rules_or_cfg=None, *, seed: int | None = None) -> KimiLinearForCausalLM:
  """Random initialisation whose parameters are created sharded (no full copy on one device).

  The init function is jitted with `out_shardings` from `abstract_state`, so each device computes
  (and holds) only its shards; the values equal the same jitted init on one device, bit for bit,
  because JAX's threefry random bits do not depend on the partitioning (an eager, un-jitted init
  can differ in the last ulp: XLA fuses the initialisers' arithmetic differently).

  Args:
    cfg: model config. mesh: the mesh. rules_or_cfg: rules (default: `cfg`'s).
    seed: PRNG seed, default `cfg.init_seed`.
  """
  seed = int(cfg.init_seed if seed is None else seed)
  graphdef, abs_state = abstract_state(cfg, mesh, rules_or_cfg)
  check_fits(cfg, abs_state, mesh)
  args = _args(cfg)

  def init():
    return nnx.state(KimiLinearForCausalLM(args, rngs=nnx.Rngs(seed)))

  return nnx.merge(graphdef, jax.jit(init, out_shardings=partitioning.state_shardings(abs_state))())


def shard_state(state, cfg, mesh: Mesh, rules_or_cfg=None):
  """Places an existing model state (e.g. made on the host) onto the mesh with `jax.device_put`."""
  _, abs_state = abstract_state(cfg, mesh, rules_or_cfg)
  return jax.device_put(state, partitioning.state_shardings(abs_state))


def create(cfg, mesh: Mesh | None = None, *, seed: int | None = None) -> KimiLinearForCausalLM:
  """A randomly initialised model of `cfg` (seed `cfg.init_seed` unless given): eagerly on one
  device (`mesh` None), else born sharded on `mesh` (`init_sharded`).

  Raises:
    ModelTooLargeError: the parameters would not fit (`check_fits`; `allow_large_model=true` skips it).
  """
  if mesh is not None:
    return init_sharded(cfg, mesh, seed=seed)
  check_fits(cfg, nnx.state(abstract_model(cfg)), None)
  return KimiLinearForCausalLM(_args(cfg), rngs=nnx.Rngs(int(cfg.init_seed if seed is None else seed)))


def restore(path: str | os.PathLike, cfg, mesh: Mesh | None = None) -> KimiLinearForCausalLM:
  """The model of `cfg` with the parameters of checkpoint `path` (`model/checkpoint/format.py`
  layout: written by training, `save_parameters` or the converter), restored on one device or
  straight into `mesh`'s shardings, whatever mesh wrote them (each host reads only its chunks).

  Before the restore every stored parameter is read once on the host (`ckpt.check_parameters`):
  its CRC-32 is checked against the checkpoint's checksums.json (`verify_checksums=false` in `cfg`
  skips that; a checkpoint without checksums loads with a one-line notice), and it is refused if it
  holds a NaN or an infinity (`allow_non_finite=true` skips that, for debugging; a non-finite weight
  otherwise yields pad-only generations or `perplexity nan`). Cost: one extra sequential read of
  params/ (usually from the page cache) plus CRC-32; measured in docs/checkpoints.md "Integrity".

  Raises:
    CheckpointError: missing checkpoint, a mismatch with the model, a parameter whose bytes do not
      match its checksum, or a non-finite parameter (one line naming it). ConfigError: a parameter that cannot be split on this mesh.
    ModelTooLargeError: the parameters would not fit (`check_fits`, before anything is read;
      `allow_large_model=true` skips it).
  """
  if mesh is None:
    graphdef, state = nnx.split(abstract_model(cfg))
  else:
    graphdef, state = abstract_state(cfg, mesh, cfg)
  check_fits(cfg, state, mesh)
  ckpt.check_parameters(path, verify_checksums=bool(cfg.get("verify_checksums", True)),
                        allow_non_finite=bool(cfg.get("allow_non_finite", False)))
  return nnx.merge(graphdef, ckpt.restore_parameters(os.path.abspath(path), state))


def load(path: str | os.PathLike, overrides: Sequence[str] = (), *, config=None, mesh="job",
         abstract: bool = False) -> Loaded:
  """The model stored at checkpoint `path`: the one load path of every tool.

  Args:
    path: a checkpoint directory (config.json + params/).
    overrides: `key=value` strings applied on top of the stored config (e.g. `attention=kda_reference`,
      `dtype=bfloat16`, the job's `ici_*_parallelism`); ignored when `config` is given.
    config: the config to build, already read (`read_config(path, overrides)`) or the caller's own
      (training from given parameters): config.json is then not read again.
    mesh: "job" (default): start the multi-host runtime when `distributed_init` is set, then the
      job's mesh of the `ici_*_parallelism` keys (`partitioning.job_mesh`; None on one device);
      None: one device; or a `Mesh`.
    abstract: return the model with `jax.ShapeDtypeStruct` leaves without reading any array.

  Returns:
    `Loaded(model, config, mesh)`; the config's `load_parameters_path` is the checkpoint and its
    `tokenizer_path` the checkpoint's tokenizer copy (absolute), if any.

  Raises:
    CheckpointError: missing/corrupt checkpoint or a mismatch with the (overridden) config.
    ConfigError: a bad override or an impossible mesh.
  """
  path = os.path.abspath(path)  # Orbax refuses relative checkpoint paths
  cfg = read_config(path, overrides) if config is None else config
  if isinstance(mesh, str):
    if mesh != "job":
      raise ValueError(f"mesh must be 'job', None or a jax.sharding.Mesh, got {mesh!r}")
    partitioning.initialize_distributed(cfg)  # before any device is touched
    mesh = partitioning.job_mesh(cfg)
  if abstract:
    return Loaded(abstract_model(cfg), cfg, mesh)
  return Loaded(restore(path, cfg, mesh), cfg, mesh)


def load_model(path: str | os.PathLike, overrides: Sequence[str] = (), *, abstract: bool = False):
  """`(model, config)` of `load(path, overrides, mesh=None)`: one device, for scripts and tests."""
  loaded = load(path, overrides, mesh=None, abstract=abstract)
  return loaded.model, loaded.config
