"""Compile a training step, a prefill or a decode step for a TPU topology ahead of time; report per-device memory.

    .venv-tpu-aot/bin/python -m tools.aot_compile CONFIG compile_topology=NAME [compile_topology_num_slices=N]
        mode=train|prefill|decode [key=value ...] [output_json=OUT]

    kda-aot-compile kimi_linear_48b_a3b compile_topology=v5p:4x4x4 mode=train batch_size=64 seq_len=4096 \\
        ici_fsdp_parallelism=64 ici_data_parallelism=1

As MaxText's train_compile.py: libtpu's compiler runs on this CPU host for the topology's devices
(`jax.experimental.topologies`), nothing is allocated (parameters, AdamW state, caches and inputs are
abstract arrays carrying their shardings), and the compiled program's `memory_analysis()` says what each
device would hold. CONFIG is a config name (configs/) or a .py/.json path; every other argument is a
config key (configs/base.py: mesh `ici_*` / `dcn_*_parallelism`, `logical_axis_rules`, `batch_size`,
`seq_len`, `max_num_segments`, `max_cache_length`, `dtype`, ...) or one of:

  compile_topology=NAME             a jax TPU topology, e.g. v5e:2x2, v5p:4x4x4, v6e:4x4, tpu7x:2x2x1 (required)
  compile_topology_num_slices=N     slices over DCN (default 1); the dcn_*_parallelism sizes must multiply to N
  mode=train|prefill|decode         the program (default train); shapes: model/aot.py
  stacked_params=true|false         prefill/decode with scan_layers: the scanned layers' parameters are
                                    arguments already stacked (default true, as a server stacks them
                                    once at load); false stacks them inside the program (a second copy)
  output_json=PATH                  also write the report (with the compiled HLO text) there
  compiled_trainstep_file=PATH      mode=train: also write the compiled step there, for
                                    `kda-train ... compiled_trainstep_file=PATH` on the target (it loads
                                    in seconds instead of compiling; same jax, device kind, device count
                                    and step-shaping keys, checked when it loads: model/training/compiled_step.py)
  overwrite=true                    replace an existing output_json or compiled_trainstep_file

Prints per device: arguments, outputs, temporaries, total, the device's usable HBM, one verdict line
("fits: ..." / "does not fit in ... by X GiB: needs ..."), the compiler's FLOP count per step and the
compile time; the last stdout line is the report as JSON (without the HLO; its "verdict" is the line).
The usable HBM is libtpu's own figure (a probe compile reads it from libtpu's out-of-memory message:
15.75 GiB per v5e device, 95.73 v5p, 31.24 v6e, 94.74 per TPU7x device), not the nominal 16/95/32/96.
A program that does not fit, whether its memory_analysis total exceeds the usable HBM or libtpu
refuses it at compile (RESOURCE_EXHAUSTED: then only libtpu's total is known), is a report, not an error.

Exit status: 0 fits; 3 does not fit (the report is still printed and written); 2 bad input (one
`error:` line naming the key). Runs only under a jax with libtpu (.venv-tpu-aot).
"""

from __future__ import annotations

import importlib.util
import json
import sys

from model import registry
from model.config import load_config
from model.errors import UsageError
from tools import cli

TOOL_KEYS = ("compile_topology", "compile_topology_num_slices", "mode", "stacked_params")
MODES = ("train", "prefill", "decode")
# The program shapes model.config does not range-check (it checks max_num_segments, max_cache_length).
SHAPE_KEYS = ("batch_size", "seq_len")
MEMORY_KEYS = "batch_size, seq_len, max_cache_length or the mesh sizes"
GIB = 2**30
EXIT_DOES_NOT_FIT = 3


def _split(argv):
  """(config argv, tool keys): the tool's own keys out of the config overrides."""
  rest, own = [], {}
  for a in argv:
    key = a.split("=", 1)[0].strip().lstrip("-") if "=" in a else None
    if key in TOOL_KEYS:
      if key in own:
        raise UsageError(f"argument {key!r} given twice")
      own[key] = a.split("=", 1)[1]
    else:
      rest.append(a)
  return rest, own


def _parse(argv):
  rest, own = _split(argv)
  if not rest or "=" in rest[0]:
    raise UsageError("the first argument is the model config (a name in configs/ or a .py/.json path), "
                     "e.g. kimi_linear_48b_a3b (see --help)")
  cfg = load_config(rest, other_keys=TOOL_KEYS)  # unknown keys / wrong types: ConfigError naming the key
  for key in SHAPE_KEYS:   # the compiled program's shapes: a value < 1 would fail deep inside tracing
    if int(cfg[key]) < 1:
      raise UsageError(f"{key}={cfg[key]!r} is invalid: expected an integer >= 1")
  registry.get_backend(cfg.attention)  # an unknown attention= fails before libtpu starts
  if not own.get("compile_topology"):
    raise UsageError("compile_topology is required: a TPU topology such as v5e:2x2, v5p:4x4x4 or tpu7x:2x2x1")
  mode = own.get("mode", "train")
  if mode not in MODES:
    raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
  slices_text = own.get("compile_topology_num_slices", "1")
  try:
    slices = int(slices_text)
  except ValueError:
    slices = 0
  if slices < 1:
    raise UsageError(f"compile_topology_num_slices must be an integer >= 1, got {slices_text!r}")
  stacked_text = own.get("stacked_params", "true").strip().lower()
  if stacked_text not in ("true", "false"):
    raise UsageError(f"stacked_params must be true or false, got {own['stacked_params']!r}")
  if cfg.output_json:
    cli.check_output_path(cfg.output_json, overwrite=cfg.overwrite)
  if mode == "train":   # the optimizer's keys too (warmup_steps < steps, ...): one line, not optax's traceback
    from model.training.steps import check_train_config  # noqa: PLC0415  (mode=train only: imports jax)
    check_train_config(cfg)
  if cfg.compiled_trainstep_file:
    if mode != "train":
      raise UsageError(f"compiled_trainstep_file is written for mode=train only, got mode={mode}")
    cli.check_output_path(cfg.compiled_trainstep_file, "compiled_trainstep_file", overwrite=cfg.overwrite)
  return cfg, own["compile_topology"], slices, mode, stacked_text == "true"


def _gib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / GIB:.3f} GiB"


def run(argv: list[str]) -> int:
  cfg, topology_name, slices, mode, stacked = _parse(argv)
  if importlib.util.find_spec("libtpu") is None:
    raise UsageError(f"{sys.executable} has no libtpu: run this tool with .venv-tpu-aot/bin/python "
                     "(`make install-aot` creates it)")
  from model import aot  # imports jax: with libtpu present it starts the TPU compiler
  target = aot.topology(topology_name, slices)
  report = aot.compile_for(cfg, mode, target, stacked_params=stacked)
  hlo, compiled = report.pop("hlo"), report.pop("compiled")
  m = report["memory"]
  mesh = " ".join(f"{a}={s}" for a, s in report["mesh"].items())
  print(f"{cfg.model_name} {mode} on {topology_name} x{slices} ({report['num_devices']} devices, "
        f"{target.device_kind}), mesh {mesh}, batch {report['batch_size']} x {report['seq_len']}, "
        f"{report['num_slots']} slots, cache {report['cache_length']}")
  print("per device:" + (" (libtpu refused the program: it states only the total)" if m["refused_by_compiler"]
                         else ""))
  if not m["refused_by_compiler"]:
    print(f"  arguments    {_gib(m['argument_bytes'])}")
    print(f"  outputs      {_gib(m['output_bytes'])} (of which {_gib(m['alias_bytes'])} reuse donated arguments)")
    print(f"  temporaries  {_gib(m['temp_bytes'])}")
  print(f"  total        {_gib(m['total_bytes'])}")
  print(f"  usable HBM   {_gib(m['hbm_bytes'])} (libtpu's figure; nominal {_gib(report['hbm_spec_bytes'])})")
  report["verdict"] = aot.verdict(m, target.device_kind)
  print(f"verdict: {report['verdict']}")
  f = report["flops_per_device"]
  print(f"compiler FLOPs per step per device: {'n/a' if f is None else f'{f:.4g}'}")
  print(f"compile time: {report['compile_seconds']:.1f} s (lowering {report['lower_seconds']:.1f} s)")
  if cfg.output_json:
    cli.write_json_atomic(cfg.output_json, {**report, "hlo": hlo}, overwrite=cfg.overwrite)
  if cfg.compiled_trainstep_file and compiled is not None:
    from model.training import compiled_step  # noqa: PLC0415
    head = compiled_step.header(cfg, target.device_kind, report["num_devices"], report["mesh"])
    size = compiled_step.save(cfg.compiled_trainstep_file, compiled, head, overwrite=cfg.overwrite)
    report["compiled_trainstep_file"] = {"path": str(cfg.compiled_trainstep_file), "bytes": size}
    print(f"wrote the compiled train step to {cfg.compiled_trainstep_file} ({size / 2**20:.1f} MiB)")
  elif cfg.compiled_trainstep_file:
    print("compiled_trainstep_file: not written (the compiler refused the program)")
  print(json.dumps({**report, "has_tpu_custom_call": hlo is not None and "tpu_custom_call" in hlo}))
  return 0 if m["fits"] else EXIT_DOES_NOT_FIT


main = cli.tool_main(run, __doc__)
command = cli.command(main)

if __name__ == "__main__":
  command()
