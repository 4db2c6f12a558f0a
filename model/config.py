"""Loading, overriding, validating and serialising model configurations.

`load_config(["tiny", "hidden_size=64", "kda_layers=[1,3]"])` takes an optional model-config name
(a module of the `configs` package, dashes read as underscores) or path (`.py` with `get_config()`,
or `.json` written by `config_to_json`), then MaxText-style `key=value` overrides. Values are parsed
against the type of the key's default: ints, floats, `true/false`, strings, lists `[a,b]` and `none`:
None for the keys in `configs.base.NULLABLE`, "" (unset) for a string key whose default is ""
(`tokenizer_path=none`, `output_json=none`), the word "none" for the other string keys (where it is a
value: `remat_policy=none`, `split_long=none`); any other key refuses it.

`with matmul_precision(cfg.matmul_precision):` is how a job applies its `matmul_precision` key (jax's
matmul precision, read when jit traces) around the programs it traces.
"""

from __future__ import annotations


import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import json
import pathlib
import warnings
from collections.abc import Sequence

import jax
import ml_collections

from configs import base
from model import partitioning
from model.errors import ConfigError  # re-exported: `from model.config import ConfigError`

_CONFIGS_DIR = pathlib.Path(base.__file__).parent
_DTYPES = ("float32", "bfloat16")
_BOOL = {"true": True, "false": False}
# remat_policy values (MaxText's names); model/nn/scan.py maps each to a jax.checkpoint policy.
REMAT_POLICY_NAMES = ("none", "full", "nothing_saveable", "minimal", "dots_saveable")


# model/nn/moe.py's expert implementations (config key moe_impl; "auto" is the rule in its docstring).
MOE_IMPLS = ("auto", "dense", "ragged", "megablox")
# matmul_precision values: jax.default_matmul_precision's names (MaxText's key of that name takes the same).
MATMUL_PRECISIONS = ("default", "high", "highest")

def available_configs() -> list[str]:
  """Names accepted by `load_config` (module names of `configs/` with dashes)."""
  return sorted(p.stem.replace("_", "-") for p in _CONFIGS_DIR.glob("*.py")
                if p.stem not in ("__init__",))


def _load_named(name: str) -> ml_collections.ConfigDict:
  path = pathlib.Path(name)
  if path.suffix == ".json":
    if not path.is_file():
      raise ConfigError(f"config file {name!r} does not exist")
    try:
      return config_from_json(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ConfigError(f"config file {name!r} is not valid JSON: {e}") from None
  if path.suffix == ".py":
    if not path.is_file():
      raise ConfigError(f"config file {name!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_model_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
    except SyntaxError as e:   # the file's own runtime errors keep their traceback (user code)
      raise ConfigError(f"config file {name!r} is not valid Python: {e.msg} (line {e.lineno})") from None
  else:
    module_name = name.replace("-", "_")
    if module_name not in [n.replace("-", "_") for n in available_configs()]:
      close = difflib.get_close_matches(name, available_configs(), n=3)
      hint = f"did you mean {', '.join(close)}? " if close else ""
      raise ConfigError(f"unknown model config {name!r}; {hint}available: {', '.join(available_configs())}, "
                        f"or a path to a .py/.json file")
    module = importlib.import_module(f"configs.{module_name}")
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config module {name!r} defines no get_config()")
  return module.get_config()


def _expected_type(cfg, key):
  if key in base.NULLABLE:
    return base.NULLABLE[key]
  return type(cfg[key])


# String keys whose default is "" but where the word "none" means something else than unset:
# compilation_cache_dir="" is the default cache directory, "none" turns the cache off.
_NONE_IS_A_WORD = frozenset({"compilation_cache_dir"})


def _unset_is_empty() -> frozenset[str]:
  """The string keys whose unset value is "" (tokenizer_path, output_json, ...): `none` sets them to ""."""
  global _UNSET_IS_EMPTY
  if _UNSET_IS_EMPTY is None:
    _UNSET_IS_EMPTY = frozenset(k for k, v in base.get_config().items() if v == "") - _NONE_IS_A_WORD
  return _UNSET_IS_EMPTY


_UNSET_IS_EMPTY: frozenset[str] | None = None


def _parse_scalar(key: str, text: str, typ):
  low = text.strip().lower()
  if low == "none":
    if key in base.NULLABLE:
      return None
    if typ is str:   # unset ("") where that is the key's default; else the word itself (remat_policy=none)
      return "" if key in _unset_is_empty() else low
    raise ConfigError(f"{key} cannot be none; it expects {typ.__name__}")
  try:
    if typ is bool:
      if low not in _BOOL:
        raise ValueError
      return _BOOL[low]
    if typ is int:
      return int(text)
    if typ is float:
      return float(text)
    if typ is str:
      return text
  except ValueError:
    raise ConfigError(f"{key} expects {typ.__name__}, got {text!r}") from None
  raise ConfigError(f"{key} has unsupported type {typ.__name__} for command-line overrides")


def _parse_list(key: str, text: str, default: list):
  t = text.strip()
  if not (t.startswith("[") and t.endswith("]")):
    raise ConfigError(f"{key} expects a list written [a,b,...], got {text!r}")
  inner = t[1:-1].strip()
  items = [s.strip() for s in inner.split(",")] if inner else []
  elem = type(default[0]) if default else int
  return [_parse_scalar(f"{key}[{i}]", s, elem) for i, s in enumerate(items)]


def _unknown_key(cfg, key, other_keys: Sequence[str] = ()):
  close = difflib.get_close_matches(key, list(cfg.keys()) + list(other_keys), n=3, cutoff=0.5)
  hint = f"; did you mean {', '.join(close)}?" if close else ""
  return ConfigError(f"unknown config key {key!r}{hint} (see configs/base.py for every key)")


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str], *,
                    other_keys: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Applies `key=value` strings in order to a copy of `cfg` and returns it. `other_keys`: names the
  caller takes out of the arguments itself (a tool's own keys), offered too when a key is unknown.

  Raises:
    ConfigError: a malformed override, an unknown key (with the closest valid names), or a value
      that does not parse as the key's type (naming the key and the expected type).
  """
  cfg = ml_collections.ConfigDict(cfg)  # deep copy keeps the lock
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must be written key=value")
    key, text = item.split("=", 1)
    key = key.strip().lstrip("-")
    if key in base.RENAMED:
      warnings.warn(f"config key {key!r} is deprecated; write {base.RENAMED[key]}={text} (the old name will be "
                    f"removed)", DeprecationWarning, stacklevel=2)
      key = base.RENAMED[key]
    if key not in cfg:
      raise _unknown_key(cfg, key, other_keys)
    default = cfg[key]
    typ = _expected_type(cfg, key)
    value = _parse_list(key, text, default) if typ is list else _parse_scalar(key, text, typ)
    set_value(cfg, key, value)
  return cfg


def set_value(cfg: ml_collections.ConfigDict, key: str, value) -> None:
  """Sets one existing key with a type check (ConfigError naming the key and expected type)."""
  if key not in cfg:
    raise _unknown_key(cfg, key)
  typ = _expected_type(cfg, key)
  ok = (value is None and key in base.NULLABLE) or isinstance(value, typ) or (
      typ is float and isinstance(value, int) and not isinstance(value, bool))
  if typ is int and isinstance(value, bool):
    ok = False
  if not ok:
    raise ConfigError(f"{key} expects {typ.__name__}, got {type(value).__name__} {value!r}")
  with cfg.unlocked():
    cfg[key] = float(value) if typ is float and value is not None else value


def load_config(argv: Sequence[str] | None = None, *, other_keys: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Builds a validated, locked config from `[model_config] key=value ...`.

  Args:
    argv: strings; the first may be a config name (`tiny`, `demo`, `kimi-linear-48b-a3b`) or a
      `.py`/`.json` path; every other item is a `key=value` override. None or [] gives the base.
    other_keys: a tool's own keys (already taken out of argv), also suggested for an unknown key.

  Returns:
    A locked `ml_collections.ConfigDict` that passed `validate_config`.

  Raises:
    ConfigError: unknown config or key, bad value type, or an invalid model (see validate_config).
  """
  argv = list(argv or [])
  if argv and "=" not in argv[0]:
    cfg = _load_named(argv.pop(0))
  else:
    cfg = base.get_config()
  cfg = apply_overrides(cfg, argv, other_keys=other_keys)
  validate_config(cfg)
  cfg.lock()
  return cfg


def _check_layers(cfg) -> None:
  n = cfg.num_hidden_layers
  kda, mla = list(cfg.kda_layers), list(cfg.full_attn_layers)
  for name, lst in (("kda_layers", kda), ("full_attn_layers", mla)):
    bad = [i for i in lst if not 1 <= i <= n]
    if bad:
      # The usual cause is a changed num_hidden_layers: both layer lists must then change with it.
      raise ConfigError(f"{name} holds {bad}, outside 1..num_hidden_layers={n} (layer lists are 1-indexed); "
                        f"kda_layers and full_attn_layers together must cover exactly 1..{n}: set both with "
                        f"num_hidden_layers (now kda_layers={kda}, full_attn_layers={mla})")
    dup = sorted({i for i in lst if lst.count(i) > 1})
    if dup:
      raise ConfigError(f"{name} lists layers {dup} more than once")
  both = sorted(set(kda) & set(mla))
  if both:
    raise ConfigError(f"layers {both} are in both kda_layers and full_attn_layers; each layer has one mixer")
  missing = sorted(set(range(1, n + 1)) - set(kda) - set(mla))
  if missing:
    raise ConfigError(f"layers {missing} are in neither kda_layers nor full_attn_layers; together they must "
                      f"cover exactly 1..num_hidden_layers={n}: set both with num_hidden_layers")


def validate_config(cfg) -> None:
  """Checks cross-key consistency; raises ConfigError with the offending keys named."""
  _check_layers(cfg)
  positive = ["vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "kda_num_heads",
              "kda_head_dim", "kda_conv_kernel_size", "num_attention_heads", "kv_lora_rank",
              "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "n_group", "topk_group", "max_num_segments", "max_cache_length"]
  for key in positive:
    if cfg[key] < 1:
      raise ConfigError(f"{key} must be >= 1, got {cfg[key]}")
  for key in ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"):
    if cfg[key] < 0:
      raise ConfigError(f"{key} must be >= 0, got {cfg[key]}")
  if cfg.kda_conv_kernel_size < 2:
    raise ConfigError(f"kda_conv_kernel_size must be >= 2 (the conv cache holds W-1 inputs), got {cfg.kda_conv_kernel_size}")
  if cfg.num_experts_per_tok > cfg.num_experts:
    raise ConfigError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts={cfg.num_experts}")
  if cfg.num_experts % cfg.n_group:
    raise ConfigError(f"num_experts={cfg.num_experts} must be divisible by n_group={cfg.n_group}")
  if cfg.topk_group > cfg.n_group:
    raise ConfigError(f"topk_group={cfg.topk_group} exceeds n_group={cfg.n_group}")
  if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
    raise ConfigError("group-limited routing scores each group by its top-2 experts; need >= 2 experts per group")
  if cfg.n_group > 1 and cfg.num_experts_per_tok > cfg.topk_group * (cfg.num_experts // cfg.n_group):
    raise ConfigError("num_experts_per_tok exceeds the experts left after group selection (topk_group * E / n_group)")
  for key in ("dtype", "weight_dtype"):
    if cfg[key] not in _DTYPES:
      raise ConfigError(f"{key} must be one of {list(_DTYPES)}, got {cfg[key]!r}")
  if cfg.hidden_act != "silu":
    raise ConfigError(f"hidden_act must be 'silu' (SwiGLU), got {cfg.hidden_act!r}")
  if cfg.moe_impl not in MOE_IMPLS:
    raise ConfigError(f"moe_impl must be one of {', '.join(MOE_IMPLS)}, got {cfg.moe_impl!r}")
  if cfg.mla_impl not in ("auto", "splash", "tiled", "dense"):
    raise ConfigError(f"mla_impl must be one of auto, splash, tiled, dense, got {cfg.mla_impl!r}")
  lb = cfg.kda_gate_lower_bound
  if lb is not None and not -5.0 <= lb < 0.0:
    raise ConfigError(f"kda_gate_lower_bound must be None or in [-5, 0), got {lb}")
  if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
    raise ConfigError(f"q_lora_rank must be None or >= 1, got {cfg.q_lora_rank}")
  if cfg.remat_policy not in REMAT_POLICY_NAMES:
    raise ConfigError(f"remat_policy must be one of {', '.join(REMAT_POLICY_NAMES)}, got {cfg.remat_policy!r}")
  check_matmul_precision(cfg.matmul_precision)
  if cfg.matmul_precision != "default" and cfg.dtype == "bfloat16":
    # megablox and splash name no dot precision; Mosaic refuses HIGHEST on bf16 operands ("Bad lhs type")
    raise ConfigError(f"matmul_precision={cfg.matmul_precision} with dtype=bfloat16: the key is for float32 "
                      "matmuls, and jax's Pallas TPU kernels (megablox, splash) refuse it on bfloat16 operands; "
                      "use matmul_precision=default, or dtype=float32")
  partitioning.validate_mesh_config(cfg)  # mesh sizes, axis rules, heads/experts vs. their mesh axes


def check_matmul_precision(value) -> None:
  """Raises ConfigError naming `matmul_precision` unless `value` is one of `MATMUL_PRECISIONS`."""
  if value not in MATMUL_PRECISIONS:
    raise ConfigError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)} (MaxText's values, names of "
                      f"jax.default_matmul_precision), got {value!r}")


def _global_matmul_precision():
  """jax's process-wide `jax_default_matmul_precision` (`jax.config`'s attribute gives this thread's
  value instead while a `jax.default_matmul_precision` block is open)."""
  try:
    from jax._src import config as jax_config   # noqa: PLC0415  (private; present in 0.10.2 and 0.12)
    return jax_config.default_matmul_precision.get_global()
  except (ImportError, AttributeError):
    return jax.config.jax_default_matmul_precision


@contextlib.contextmanager
def matmul_precision(value: str):
  """The job's `matmul_precision` around the tracing of its programs (train, generate, serve,
  perplexity, the ahead-of-time compile): jax's `jax_default_matmul_precision`, which a trace records
  in every dot that names no precision of its own (a StableHLO `precision = [HIGHEST, HIGHEST]`), so it
  must be on while jit traces; compiling and running the traced program need nothing more.

  "default" sets nothing: the programs are those of a job without the key. Another value sets jax's
  process-wide setting for the block, and restores the previous one after it, so threads the job
  traces on (the server's engine loop) see it too: the `jax.default_matmul_precision` context manager
  alone is per thread.

  Raises:
    ConfigError: `value` is not one of `MATMUL_PRECISIONS` (names the key).
  """
  check_matmul_precision(value)
  if value == "default":
    yield
    return
  previous = _global_matmul_precision()
  jax.config.update("jax_default_matmul_precision", value)
  try:
    with jax.default_matmul_precision(value):   # this thread, over an enclosing per-thread setting
      yield
  finally:
    jax.config.update("jax_default_matmul_precision", previous)


SECTIONS = ("model", "mesh", "train", "serving")


def section_of(key: str) -> str:
  """The section of a config key: "serving", "train", "mesh" (configs/base.py lists them) or "model"."""
  if key in base.SERVING_KEYS:
    return "serving"
  if key in base.TRAIN_KEYS:
    return "train"
  if key in base.MESH_KEYS:
    return "mesh"
  return "model"


def section(cfg, name: str) -> dict:
  """`{key: value}` of one section of `cfg` (one of `SECTIONS`; the model's typed view is `ModelArgs`)."""
  if name not in SECTIONS:
    raise ValueError(f"section must be one of {SECTIONS}, got {name!r}")
  return {k: cfg[k] for k in cfg.keys() if section_of(k) == name}


def config_to_json(cfg, *, sections: Sequence[str] = SECTIONS) -> str:
  """Serialises the keys of `sections` of a config (default: every key) to a JSON string."""
  data = {k: v for k, v in cfg.to_dict().items() if section_of(k) in sections}
  return json.dumps(data, indent=2, sort_keys=True)


def checkpoint_json(cfg) -> str:
  """The config.json of a checkpoint: the model section only (tool, training and mesh keys belong to
  a job, not to the parameters; a load fills them from the command line or the base defaults)."""
  return config_to_json(cfg, sections=("model",))


def config_from_json(text: str, *, validate: bool = True) -> ml_collections.ConfigDict:
  """Rebuilds a locked, validated config from `config_to_json` output (`validate=False`: the caller
  validates once after applying its own overrides, as `model.checkpoint.format.read_config` does).

  Keys missing from the JSON (added to base after the checkpoint was written) keep base defaults;
  unknown keys raise ConfigError with the closest valid names; values are type-checked.
  """
  data = json.loads(text)
  if not isinstance(data, dict):
    raise ConfigError("a JSON config must be an object of key: value")
  cfg = base.get_config()
  for key, value in data.items():
    set_value(cfg, base.RENAMED.get(key, key), value)  # files written before a rename keep loading
  if validate:
    validate_config(cfg)
  cfg.lock()
  return cfg


@dataclasses.dataclass(frozen=True)
class ModelArgs:
  """The hashable, static view of a config that modules keep (a ConfigDict is not hashable).

  Layer kinds are 0-indexed here: `layer_types[i]` is "kda" or "mla".
  """

  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  intermediate_size: int
  rms_norm_eps: float
  layer_types: tuple[str, ...]
  kda_num_heads: int
  kda_head_dim: int
  kda_conv_kernel_size: int
  kda_gate_lower_bound: float | None
  kda_implementation: str
  num_attention_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  mla_kv_norm_eps: float
  first_k_dense_replace: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  num_shared_experts: int
  routed_scaling_factor: float
  norm_topk_prob: bool
  n_group: int
  topk_group: int
  moe_impl: str
  attention: str
  dtype: str
  weight_dtype: str
  initializer_range: float
  max_num_segments: int
  max_cache_length: int
  scan_layers: bool = False
  remat_policy: str = "full"
  mla_impl: str = "auto"

  @classmethod
  def from_config(cls, cfg, *, validate: bool = True) -> "ModelArgs":
    """Validates `cfg` (unless the caller just did: `validate=False`) and extracts the model fields."""
    if validate:
      validate_config(cfg)
    kda = set(cfg.kda_layers)
    types = tuple("kda" if i + 1 in kda else "mla" for i in range(cfg.num_hidden_layers))
    names = [f.name for f in dataclasses.fields(cls) if f.name != "layer_types"]
    return cls(layer_types=types, **{n: cfg[n] for n in names})
