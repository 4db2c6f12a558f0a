"""Ahead-of-time compilation of a training step, a prefill or a decode step for a TPU topology.

As MaxText's `train_compile.py`: libtpu compiles on a CPU host for a `jax.experimental.topologies`
topology and reports `memory_analysis()` per jax device before anyone pays for the chips. Nothing is
materialised: every argument is a `jax.ShapeDtypeStruct` carrying its `NamedSharding`.

Programs (`MODES`), shaped by the config keys: `train` (the AdamW train step on `[batch_size,
seq_len]` packed rows, state donated), `prefill` (`KimiLinearForCausalLM.prefill`, MLA caches of
`max_cache_length`; KDA runs the Mosaic kernel, as on the chip) and `decode` (one token for
`batch_size` sequences, cache donated).

The fit verdict compares against the HBM libtpu lets a program use (`usable_hbm_bytes`, read by a
probe compile: a little less than the chip's). A program libtpu refuses at compile is a "does not
fit" report with the bytes libtpu says it needed, not an error. Figures: docs/performance.md,
"Kimi-Linear-48B-A3B on TPU slices (ahead of time)".

Import only in a process whose jax has libtpu (`.venv-tpu-aot`): jax starts its backends at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from model import loading, partitioning
from model.config import matmul_precision
from model.errors import ConfigError
# libtpu's compile-time OOM reading lives in model.memory (the trainer's pre-step check reads it too)
from model.memory import is_compile_oom, oom_bytes
from model.nn import cache as cache_lib
from model.nn import scan as scan_lib
from model.training import steps

MODES = ("train", "prefill", "decode")

# Nominal HBM per jax device, GiB (Cloud TPU architecture pages; TPU7x: 192 per chip, two devices).
# Reported beside libtpu's usable figure, which the verdict uses.
HBM_GIB_BY_DEVICE_KIND = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95,
                          "TPU v6 lite": 32, "TPU v6e": 32, "TPU7x": 96}


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU topology to compile for: its `devices` (from `get_topology_desc`), their kind and HBM."""

  name: str
  num_slices: int
  devices: tuple
  device_kind: str
  hbm_bytes: int        # usable HBM per device, as libtpu reports it (`usable_hbm_bytes`)
  hbm_spec_bytes: int   # the nominal HBM per device (HBM_GIB_BY_DEVICE_KIND)


def topology(name: str, num_slices: int = 1) -> Target:
  """The devices of TPU topology `name` (e.g. "v5e:2x2", "v5p:4x4x4", "tpu7x:2x2x1") x `num_slices`.

  Raises:
    ConfigError: naming `compile_topology` (unknown name, or a device kind whose HBM is not known)
      or `compile_topology_num_slices` (< 1).
  """
  from jax.experimental import topologies  # needs libtpu's topology support: only when compiling ahead of time
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ConfigError(f"compile_topology_num_slices must be an int >= 1, got {num_slices!r}")
  try:
    kw = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
      topo = topologies.get_topology_desc(topology_name=name, platform="tpu", **kw)
    except Exception as e:
      # Older libtpu (jax 0.10.2's) assumes 2x2 chips per host, so a one-chip host such as the lent
      # v5e ("v5e:1x1", a v5litepod-1) needs its host bounds given: the layout itself.
      if "chips_per_host_bounds" not in str(e):
        raise
      dims = tuple(int(d) for d in name.split(":", 1)[1].split("x"))
      topo = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                          chips_per_host_bounds=(dims + (1, 1, 1))[:3], **kw)
  except Exception as e:  # libtpu raises XlaRuntimeError / ValueError with its own text
    raise ConfigError(f"compile_topology={name!r} is not a TPU topology libtpu knows (e.g. v5e:2x2, v5p:4x4x4, "
                      f"v6e:2x2, tpu7x:2x2x1): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
  devices = tuple(topo.devices)
  kind = devices[0].device_kind
  if kind not in HBM_GIB_BY_DEVICE_KIND:
    raise ConfigError(f"compile_topology={name!r} has devices of kind {kind!r} whose HBM is not in "
                      f"model.aot.HBM_GIB_BY_DEVICE_KIND")
  return Target(name, num_slices, devices, kind, usable_hbm_bytes(devices[0]), HBM_GIB_BY_DEVICE_KIND[kind] * 2**30)


# libtpu's error compiling a collective on a topology it describes but cannot route (e.g. "v5e:9x9")
ICI_ROUTING_FAILURE = "Failed to create limited ICI routing"

PROBE_BYTES = 2**40  # more than any TPU device holds: the probe program always exceeds HBM


def usable_hbm_bytes(device) -> int:
  """The HBM per device that libtpu lets one program use on `device`'s kind (a topology device).

  Read from libtpu itself: a probe program that needs `PROBE_BYTES` (1 TiB) on one device is refused
  with "exceeds available HBM (X)", and X is the figure. Abstract topology devices have no
  `memory_stats()`.

  Raises:
    RuntimeError: the probe compiled, or libtpu's message does not state the available HBM (a libtpu
      whose wording changed: `model.memory._AVAILABLE_RE` needs updating; no figure is guessed).
  """
  mesh = jax.sharding.Mesh(np.array([device]), ("probe",))
  probe = jax.ShapeDtypeStruct((PROBE_BYTES // 4,), jnp.float32, sharding=NamedSharding(mesh, P()))
  try:
    jax.jit(lambda a: a + 1).lower(probe).compile()
  except Exception as e:
    if is_compile_oom(e):
      available = oom_bytes(e)[1]
      if available is not None:
        return available
    raise RuntimeError(f"could not read the usable HBM of {device.device_kind} from libtpu's out-of-memory "
                       f"message (model.memory._AVAILABLE_RE): {str(e).splitlines()[0] if str(e) else e!r}") from e
  raise RuntimeError(f"a {PROBE_BYTES} byte probe program compiled for {device.device_kind}: the usable HBM "
                     f"cannot be read from libtpu")


def _check_num_slices(cfg, target: Target) -> None:
  slices = math.prod(partitioning.dcn_sizes(cfg).values())
  if slices != target.num_slices:
    raise ConfigError(f"the dcn_*_parallelism sizes multiply to {slices} but compile_topology_num_slices="
                      f"{target.num_slices}: they must agree (one mesh slice per topology slice)")


def _replicated(mesh, tree):
  rep = NamedSharding(mesh, P())
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)


def _sds(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_train_state(cfg, mesh):
  """`(graphdef, state)`: the train state of `steps.init_train_state` as sharded `ShapeDtypeStruct`s.

  Parameters follow their logical axes; the AdamW moments (subtrees shaped like the parameters)
  follow the parameters; step, PRNG key and optimizer counts are replicated.
  """
  with partitioning.mesh_context(mesh, cfg):
    model = loading.abstract_model(cfg)
    graphdef, params, rest = steps.split_model(model)
    p_shard = partitioning.param_shardings(params, mesh)
    r_shard = partitioning.param_shardings(rest, mesh) if jax.tree.leaves(rest) else rest
  params = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), params, p_shard)
  rest = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), rest, r_shard)
  tx = steps.make_optimizer(steps.optimizer_hparams(cfg))
  opt = jax.eval_shape(tx.init, params)
  pdef = jax.tree.structure(params)
  rep = NamedSharding(mesh, P())

  def place(sub):
    if isinstance(sub, jax.ShapeDtypeStruct):
      return _sds(sub.shape, sub.dtype, rep)
    return jax.tree.map(lambda a, p: _sds(a.shape, a.dtype, p.sharding), sub, params)

  opt = jax.tree.map(place, opt, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
                     or jax.tree.structure(x) == pdef)
  key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  state = {"params": params, "rest": rest, "opt_state": opt, "step": _sds((), jnp.int32, rep),
           "rng": _sds(key_data.shape, key_data.dtype, rep)}
  return graphdef, state


def _stacked_sds(mesh, leaves):
  """The abstract stack of one scan-group position's per-layer leaves: `[repeats, *shape]`, each row
  sharded as the layers are (the new leading axis unsplit)."""
  a = leaves[0]
  spec = a.sharding.spec
  return _sds((len(leaves), *a.shape), a.dtype, NamedSharding(mesh, P(None, *spec)))


def _batch(mesh, cfg, shape, dtype):
  return _sds(shape, dtype, partitioning.batch_sharding(mesh, shape, rules_or_cfg=cfg))


def lower(cfg, mode: str, mesh, *, stacked_params: bool = True):
  """`jax.jit(program).lower(*abstract args)` for `mode` on `mesh` (see the module docstring), traced
  under the config's `matmul_precision` (`model.config.matmul_precision`).

  With `stacked_params` and `scan_layers` on, prefill and decode take the scanned layers' parameters
  already stacked (`scan.split_stacked`: the arguments are `(rest, stacked)`, the same bytes) and run
  under `scan.prestacked_groups`, so the program holds no second, stacked copy of them. Training
  keeps the per-layer train state (checkpoints and optimizer state are per layer).

  Returns:
    `(lowered, info)`: info names the program's shapes (batch, seq_len, slots, cache_length).

  Raises:
    ConfigError: an unknown mode, or a parameter / cache dimension that cannot be split on the mesh.
  """
  if mode not in MODES:
    raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
  b, t, n, length = int(cfg.batch_size), int(cfg.seq_len), int(cfg.max_num_segments), int(cfg.max_cache_length)
  info = {"batch_size": b, "seq_len": t, "num_slots": n, "cache_length": length}
  with partitioning.mesh_context(mesh, cfg), matmul_precision(cfg.matmul_precision):
    if mode == "train":
      graphdef, state = abstract_train_state(cfg, mesh)
      step = steps.train_step_fn(graphdef, steps.optimizer_hparams(cfg), n,
                                 float(cfg.router_bias_update_rate)).step
      ids = _batch(mesh, cfg, (b, t), jnp.int32)
      args = (state, ids, ids, _batch(mesh, cfg, (b, t), jnp.bool_), ids)
      return jax.jit(step, donate_argnums=0).lower(*args), info
    graphdef, state = loading.abstract_state(cfg, mesh, cfg)
    model = nnx.merge(graphdef, state)
    plan = model.scan_plan() if stacked_params else None
    info["stacked_params"] = plan is not None
    params = state if plan is None else scan_lib.split_stacked(
        state, plan, stack=lambda leaves: _stacked_sds(mesh, leaves))

    @contextlib.contextmanager
    def as_model(st):
      if plan is None:
        yield nnx.merge(graphdef, st)
        return
      rest, stacked = st  # the scanned layers' parameters arrive stacked, as a server stacks them at load
      with scan_lib.prestacked_groups(stacked):
        yield nnx.merge(graphdef, scan_lib.merge_stacked(rest, stacked, plan))

    if mode == "prefill":
      ids = _batch(mesh, cfg, (b, t), jnp.int32)

      def prefill(st, input_ids, segment_ids):
        with as_model(st) as m:
          return m.prefill(input_ids, segment_ids, num_slots=n, cache_length=length, logits_at="last")

      return jax.jit(prefill).lower(params, ids, ids), info
    info.update(num_slots=1, seq_len=1)
    abs_cache = jax.eval_shape(lambda: model.init_cache(b, num_slots=1, cache_length=length))
    cache = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), abs_cache,
                         cache_lib.shardings(abs_cache, mesh, cfg))

    def decode(st, next_ids, c):
      with as_model(st) as m:
        return m.decode(next_ids, c)

    return jax.jit(decode, donate_argnums=2).lower(params, _batch(mesh, cfg, (b,), jnp.int32), cache), info


def memory_report(compiled, hbm_bytes: int) -> dict:
  """Per-device bytes of a compiled program (`memory_analysis()`) and the fit verdict.

  total = arguments + outputs - aliased (donated buffers reused as outputs) + temporaries; the
  program fits when total <= `hbm_bytes` (the usable HBM per device).
  """
  m = compiled.memory_analysis()
  args, out, alias, temp = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                            int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))
  total = args + out - alias + temp
  return {"argument_bytes": args, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
          "generated_code_bytes": int(m.generated_code_size_in_bytes), "total_bytes": total,
          "hbm_bytes": int(hbm_bytes), "fits": total <= hbm_bytes, "margin_bytes": int(hbm_bytes - total),
          "refused_by_compiler": False}


def refused_report(e: BaseException, hbm_bytes: int) -> dict:
  """The memory report of a program libtpu refused for memory: only the total it says it needed.

  The byte breakdown (arguments, outputs, temporaries) is None: libtpu states one figure. The total
  and margin are None too when its message does not state the requirement.
  """
  required, available = oom_bytes(e)
  hbm = int(available if available is not None else hbm_bytes)
  text = str(e).strip()
  # libtpu says "memory required for HLO temporaries (X)", but X is the whole program (probe:
  # docs/performance.md, "Kimi-Linear-48B-A3B on TPU slices (ahead of time)").
  return {"argument_bytes": None, "output_bytes": None, "alias_bytes": None, "temp_bytes": None,
          "generated_code_bytes": None, "total_bytes": required, "hbm_bytes": hbm, "fits": False,
          "margin_bytes": None if required is None else hbm - required, "refused_by_compiler": True,
          "compiler_message": text.splitlines()[0], "compiler_detail": text[:20000]}


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB"


def verdict(memory: dict, device_kind: str) -> str:
  """The one-line verdict of a memory report: "fits: ..." or "does not fit ... by X GiB" (GiB = 2**30 B).

  The available figure is libtpu's usable HBM per device (`usable_hbm_bytes`).
  """
  hbm = f"{_gib(memory['hbm_bytes'])} usable HBM per {device_kind} device (libtpu)"
  if memory["fits"]:
    return f"fits: {_gib(memory['total_bytes'])} of {hbm}, {_gib(memory['margin_bytes'])} to spare"
  how = "libtpu refused the program at compile" if memory["refused_by_compiler"] else "memory_analysis total"
  if memory["total_bytes"] is None:
    return f"does not fit in {hbm} ({how}; it states no byte count: {memory.get('compiler_message')})"
  return (f"does not fit in {hbm} by {_gib(-memory['margin_bytes'])}: needs {_gib(memory['total_bytes'])} "
          f"({how})")


def flops(compiled) -> float | None:
  """The compiler's FLOP count of one run of the program per device (`cost_analysis()["flops"]`)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  value = (cost or {}).get("flops")
  return None if value is None else float(value)


def compile_for(cfg, mode: str, target: Target, *, stacked_params: bool = True) -> dict:
  """Lowers and compiles `mode` for `target` with the config's mesh; the report of one compile.

  Returns:
    dict with topology, device_kind, num_devices, mesh (axis sizes), the shapes, memory
    (`memory_report`, or `refused_report` when libtpu refuses the program for memory; then
    flops_per_device and hlo are None), flops_per_device, compile_seconds, hlo (the compiled HLO
    text), compiled (the `jax.stages.Compiled`, or None) and hbm_spec_bytes (the nominal HBM per
    device).

  Raises:
    ConfigError: a mesh that does not divide the topology's devices, heads or experts that do not
      divide their mesh axes, dcn sizes that disagree with the slice count, an unknown mode, a topology
      whose collectives libtpu cannot route.
  """
  _check_num_slices(cfg, target)
  mesh = partitioning.create_mesh(cfg, target.devices)
  t0 = time.perf_counter()
  lowered, info = lower(cfg, mode, mesh, stacked_params=stacked_params)
  t1 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:
    if ICI_ROUTING_FAILURE in str(e):   # libtpu makes the topology but cannot route its collectives
      raise ConfigError(f"compile_topology={target.name!r}: libtpu cannot route collectives between its "
                        f"{len(target.devices)} devices: not a slice shape this TPU generation offers (v5e's, for "
                        f"one: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16)") from None
    if not is_compile_oom(e):
      raise
    compiled = None
    memory = refused_report(e, target.hbm_bytes)
  else:
    memory = memory_report(compiled, target.hbm_bytes)
  t2 = time.perf_counter()
  return {"topology": target.name, "num_slices": target.num_slices, "device_kind": target.device_kind,
          "num_devices": len(target.devices), "mode": mode,
          "mesh": {a: int(s) for a, s in zip(mesh.axis_names, np.shape(mesh.devices))},
          **info, "memory": memory, "hbm_spec_bytes": target.hbm_spec_bytes,
          "flops_per_device": None if compiled is None else flops(compiled),
          "lower_seconds": t1 - t0, "compile_seconds": t2 - t1,
          "hlo": None if compiled is None else compiled.as_text(), "compiled": compiled}
