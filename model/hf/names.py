"""Hugging Face Kimi-Linear checkpoint layout: config.json <-> the project's config, and the tensor
name/shape table between HF safetensors and the model's parameter tree.

The table is derived from the model's own parameters (`model.loading.abstract_model`), by the
rules of the "Parameter names" table in model/README.md (checked against the tensors listed in
tests/fixtures/README.md):

  kind      HF tensor(s)                                   model parameter
  linear    `X.weight [out, in]`                           `X.kernel [in, out]` (transpose)
  copy      `X.weight` (norms, embedding), `dt_bias`,      `X.scale`, `embed_tokens.embedding`,
            `gate.e_score_correction_bias`                 same names, same shape
  conv      `self_attn.{q,k,v}_conv1d.weight [D, 1, W]`    `...kernel [W, D]` (`w[:, 0, :].T`)
  a_log     `self_attn.A_log [1, 1, H, 1]`                 `self_attn.A_log [H]` (reshape)
  experts   `experts.{e}.w1/w3.weight [I, d]` (e < E),     `experts.w1/w3 [E, d, I]`, row e = HF_e^T
            `experts.{e}.w2.weight [d, I]`                 `experts.w2 [E, I, d]`, row e = HF_e^T

Dense FFN layers are named `model.layers.{i}.mlp.*` in the released checkpoints and
`model.layers.{i}.block_sparse_moe.{gate,up,down}_proj` by transformers' `save_pretrained`; both are
read, the released spelling is written.

HF config.json (transformers `KimiLinearConfig` / Moonshot's released configs) -> project keys:
`linear_attn_config.{kda_layers, full_attn_layers}` (1-indexed) -> `kda_layers`, `full_attn_layers`;
`linear_attn_config.{num_heads, head_dim, short_conv_kernel_size}` -> `kda_num_heads`,
`kda_head_dim`, `kda_conv_kernel_size`; `num_experts_per_token` (or `num_experts_per_tok`) ->
`num_experts_per_tok`; `moe_renormalize` (or `norm_topk_prob`) -> `norm_topk_prob`;
`num_expert_group` (or `n_group`) -> `n_group`; `num_shared_experts` (or `n_shared_experts`); the
rest keep their names. The top-level `head_dim` is transformers' copy of `qk_rope_head_dim` and is
not the KDA head dim. Features the model does not implement (tied embeddings, attention biases,
RoPE in MLA, a non-sigmoid router, MTP layers, MoE every k-th layer) raise `LayoutError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Iterator, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from model.errors import UserError
from model.config import ConfigError, apply_overrides, load_config, set_value, validate_config

LINEAR, COPY, CONV, A_LOG, EXPERTS = "linear", "copy", "conv", "a_log", "experts"

# safetensors dtype codes <-> numpy (bfloat16 from ml_dtypes, as jax uses).
ST_TO_NP = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(ml_dtypes.bfloat16)}
NP_TO_ST = {v: k for k, v in ST_TO_NP.items()}
MODEL_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class LayoutError(UserError):
  """An HF config or tensor that does not describe this model (the message names the key/tensor)."""


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------

# Keys transformers or Moonshot write that carry nothing the model needs (or are checked elsewhere).
_IGNORED = {
    "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_router_logits", "pretraining_tp", "model_max_length", "max_position_embeddings",
    "attention_dropout", "num_key_value_heads", "qk_head_dim", "head_dim", "layer_types",
    "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "rope_theta",
    "rope_scaling", "rope_parameters", "use_grouped_topk", "topk_method", "_name_or_path",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "output_attentions", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "tokenizer_class", "generation_config", "problem_type", "finetuning_task", "torchscript",
    "moe_layer_freq", "mla_use_nope", "moe_router_activation_func", "tie_word_embeddings",
    "attention_bias", "num_nextn_predict_layers", "model_type", "hidden_act",
}
# HF key -> (project key, aliases HF also accepts); values are copied after a type check.
_DIRECT = {
    "vocab_size": ("vocab_size", ()), "hidden_size": ("hidden_size", ()),
    "num_hidden_layers": ("num_hidden_layers", ()), "intermediate_size": ("intermediate_size", ()),
    "rms_norm_eps": ("rms_norm_eps", ()), "num_attention_heads": ("num_attention_heads", ()),
    "q_lora_rank": ("q_lora_rank", ()), "kv_lora_rank": ("kv_lora_rank", ()),
    "qk_nope_head_dim": ("qk_nope_head_dim", ()), "qk_rope_head_dim": ("qk_rope_head_dim", ()),
    "v_head_dim": ("v_head_dim", ()), "first_k_dense_replace": ("first_k_dense_replace", ()),
    "num_experts": ("num_experts", ("num_local_experts", "n_routed_experts")),
    "num_experts_per_token": ("num_experts_per_tok", ("num_experts_per_tok",)),
    "moe_intermediate_size": ("moe_intermediate_size", ()),
    "num_shared_experts": ("num_shared_experts", ("n_shared_experts",)),
    "routed_scaling_factor": ("routed_scaling_factor", ()),
    "moe_renormalize": ("norm_topk_prob", ("norm_topk_prob",)),
    "num_expert_group": ("n_group", ("n_group",)), "topk_group": ("topk_group", ()),
    "initializer_range": ("initializer_range", ()),
    "bos_token_id": ("bos_token_id", ()), "eos_token_id": ("eos_token_id", ()),
    "pad_token_id": ("pad_token_id", ()),
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
             "num_experts_per_token", "moe_intermediate_size", "linear_attn_config")
# transformers KimiLinearConfig defaults, for the optional keys (what transformers would assume).
_HF_DEFAULTS = {"rms_norm_eps": 1e-5, "q_lora_rank": None, "first_k_dense_replace": 1, "num_shared_experts": 1,
                "routed_scaling_factor": 2.446, "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1,
                "initializer_range": 0.02}
_LINEAR_ATTN_KEYS = {"kda_layers": "kda_layers", "full_attn_layers": "full_attn_layers",
                     "num_heads": "kda_num_heads", "head_dim": "kda_head_dim",
                     "short_conv_kernel_size": "kda_conv_kernel_size"}
# key: (value the model implements, what to say otherwise)
_MUST_EQUAL = {
    "model_type": ("kimi_linear", "only Kimi-Linear checkpoints (model_type 'kimi_linear') are supported"),
    "tie_word_embeddings": (False, "tied embeddings are not implemented (lm_head is separate)"),
    "attention_bias": (False, "attention biases are not implemented"),
    "mla_use_nope": (True, "the MLA layers here apply no rotary embedding (NoPE only)"),
    "moe_router_activation_func": ("sigmoid", "only the sigmoid router is implemented"),
    "moe_layer_freq": (1, "MoE in every layer after first_k_dense_replace is the only layout implemented"),
    "num_nextn_predict_layers": (0, "multi-token-prediction layers are not implemented"),
    "hidden_act": ("silu", "only SwiGLU (silu) FFNs are implemented"),
}


def _get(hf: dict, key: str, aliases: Sequence[str] = ()):
  """The value of `key` or one of its aliases; LayoutError if two spellings disagree."""
  found = [(k, hf[k]) for k in (key, *aliases) if k in hf]
  if len({json.dumps(v) for _, v in found}) > 1:
    raise LayoutError(f"config.json gives {found[0][0]}={found[0][1]!r} but {found[1][0]}={found[1][1]!r}; "
                      f"they are the same setting and must agree")
  return found[0][1] if found else _HF_DEFAULTS.get(key)


def source_dtype(hf: dict) -> str | None:
  """The checkpoint dtype named in config.json (`dtype`, or transformers 4's `torch_dtype`), or None."""
  return hf.get("dtype") or hf.get("torch_dtype")


def config_from_hf(hf: dict, *, name: str = "hf", weight_dtype: str = "float32", extra: Sequence[str] = ()):
  """An HF Kimi-Linear config.json (parsed) -> the project's locked, validated ConfigDict.

  Args:
    hf: the parsed config.json. name: stored as `model_name`. weight_dtype: "float32"/"bfloat16".
    extra: further `key=value` project overrides applied last.

  Returns:
    `(config, ignored)`: the config and the sorted config.json keys that were not understood (the
    caller may print them; known-irrelevant keys are not listed).

  Raises:
    LayoutError: not a Kimi-Linear config, a missing key, a feature the model lacks, or two keys
      that contradict each other (e.g. `layer_types` vs `linear_attn_config`); each named.
  """
  if not isinstance(hf, dict):
    raise LayoutError("config.json must hold a JSON object")
  if "model_type" not in hf:
    raise LayoutError("config.json has no model_type; expected 'kimi_linear' (is this a Kimi-Linear checkpoint?)")
  for key, (want, why) in _MUST_EQUAL.items():
    if key in hf and hf[key] != want:
      raise LayoutError(f"config.json {key}={hf[key]!r} is not supported: {why}")
  missing = [k for k in _REQUIRED if k not in hf and not any(a in hf for a in _DIRECT.get(k, ("", ()))[1])]
  if missing:
    raise LayoutError(f"config.json lacks required key(s) {missing}")
  lac = hf["linear_attn_config"]
  if not isinstance(lac, dict):
    raise LayoutError(f"config.json linear_attn_config must be an object, got {type(lac).__name__}")
  unknown_lac = sorted(set(lac) - set(_LINEAR_ATTN_KEYS))
  if unknown_lac:
    raise LayoutError(f"config.json linear_attn_config has key(s) {unknown_lac} this model does not implement "
                      f"(known: {sorted(_LINEAR_ATTN_KEYS)})")
  for k in ("kda_layers", "full_attn_layers", "num_heads", "head_dim"):
    if k not in lac:
      raise LayoutError(f"config.json linear_attn_config lacks {k!r}")

  values = {}
  for hf_key, (key, aliases) in _DIRECT.items():
    v = _get(hf, hf_key, aliases)
    if v is None and key not in ("q_lora_rank",) and hf_key not in hf:
      continue  # absent optional key without a transformers default (token ids): keep ours
    if key == "eos_token_id" and isinstance(v, list):
      v = v[0] if v else None
    if v is None and key in ("bos_token_id", "eos_token_id", "pad_token_id"):
      continue
    values[key] = v
  for hf_key, key in _LINEAR_ATTN_KEYS.items():
    if hf_key in lac:
      values[key] = lac[hf_key]
  for flat, sub in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                    ("linear_conv_kernel_dim", "short_conv_kernel_size")):
    if flat in hf and sub in lac and hf[flat] != lac[sub]:
      raise LayoutError(f"config.json {flat}={hf[flat]} contradicts linear_attn_config.{sub}={lac[sub]}")
  _check_layer_types(hf, values)

  cfg = load_config([])
  overrides = [f"model_name={name}", f"weight_dtype={weight_dtype}"]
  try:
    cfg = apply_overrides(cfg, overrides)
    for key, v in values.items():
      set_value(cfg, key, v)
    cfg = apply_overrides(cfg, list(extra))
    validate_config(cfg)
  except ConfigError as e:
    raise LayoutError(f"config.json does not describe a valid model: {e}") from None
  cfg.lock()
  known = set(_IGNORED) | set(_DIRECT) | {a for _, al in _DIRECT.values() for a in al} | {"linear_attn_config"}
  ignored = sorted(k for k in hf if k not in known)
  return cfg, ignored


def _check_layer_types(hf: dict, values: dict) -> None:
  """transformers' expanded 0-indexed `layer_types` / `mlp_layer_types` must agree with the rest."""
  n = values["num_hidden_layers"]
  for key in ("kda_layers", "full_attn_layers"):
    lst = values[key]
    if not isinstance(lst, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in lst):
      raise LayoutError(f"config.json linear_attn_config.{key} must be a list of 1-indexed layer numbers, got {lst!r}")
    bad = [i for i in lst if not 1 <= i <= n]
    if bad:
      raise LayoutError(f"config.json linear_attn_config.{key} holds {bad}, outside 1..num_hidden_layers={n} "
                        f"(the lists are 1-indexed)")
  kda = set(values["kda_layers"])
  if "layer_types" in hf and hf["layer_types"] is not None:
    lt = hf["layer_types"]
    want = ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n)]
    if list(lt) != want:
      raise LayoutError(f"config.json layer_types {lt} contradicts linear_attn_config (kda_layers "
                        f"{sorted(kda)}, 1-indexed) which gives {want}")
  if "mlp_layer_types" in hf and hf["mlp_layer_types"] is not None:
    mt = list(hf["mlp_layer_types"])
    k = values.get("first_k_dense_replace", 1)
    want = ["dense" if i < k else "sparse" for i in range(n)]
    if mt != want:
      raise LayoutError(f"config.json mlp_layer_types {mt} is not first_k_dense_replace={k} dense layers then "
                        f"MoE ({want}); only that layout is implemented")


def config_to_hf(cfg, *, dtype: str) -> dict:
  """The project's config -> an HF config.json dict that transformers' KimiLinearForCausalLM loads.

  Raises:
    LayoutError: a config transformers cannot express (the bounded KDA gate).
  """
  if cfg.kda_gate_lower_bound is not None:
    raise LayoutError("kda_gate_lower_bound is set (bounded gate); transformers' Kimi-Linear only has the "
                      "softplus gate, so the HF checkpoint would compute something else")
  n = cfg.num_hidden_layers
  kda = set(cfg.kda_layers)
  return {
      "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": dtype,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": n,
      "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
      "initializer_range": cfg.initializer_range, "tie_word_embeddings": False, "attention_bias": False,
      "linear_attn_config": {"kda_layers": sorted(kda), "full_attn_layers": sorted(cfg.full_attn_layers),
                             "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
                             "short_conv_kernel_size": cfg.kda_conv_kernel_size},
      "layer_types": ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n)],
      "mlp_layer_types": ["dense" if i < cfg.first_k_dense_replace else "sparse" for i in range(n)],
      "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
      "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
      "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "v_head_dim": cfg.v_head_dim, "mla_use_nope": True,
      "first_k_dense_replace": cfg.first_k_dense_replace, "moe_layer_freq": 1,
      "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_tok,
      "moe_intermediate_size": cfg.moe_intermediate_size, "num_shared_experts": cfg.num_shared_experts,
      "routed_scaling_factor": cfg.routed_scaling_factor, "moe_renormalize": cfg.norm_topk_prob,
      "moe_router_activation_func": "sigmoid", "num_expert_group": cfg.n_group, "topk_group": cfg.topk_group,
      "use_grouped_topk": True, "num_nextn_predict_layers": 0,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
      "use_cache": True,
  }


# ------------------------------------------------------------------------------------------------
# Tensor table
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
  """One model parameter and the HF tensor(s) it comes from.

  Attributes:
    name: dotted model name ('model.layers.0.self_attn.q_proj.kernel').
    path: the key path in the pure parameter dict (layer indices are ints).
    shape, dtype: the model parameter's shape and dtype (numpy dtype).
    kind: one of linear/copy/conv/a_log/experts (module docstring).
    hf_names: the HF tensor names (E names for `experts`, else one).
    hf_shape: the shape of each HF tensor.
    aliases: other accepted spellings, `{hf_name: alias}` (dense FFN names).
    layer: decoder-layer index, or None for embedding / final norm / lm_head.
  """

  name: str
  path: tuple
  shape: tuple[int, ...]
  dtype: np.dtype
  kind: str
  hf_names: tuple[str, ...]
  hf_shape: tuple[int, ...]
  aliases: dict
  layer: int | None

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize


_CONV = re.compile(r"\.[qkv]_conv1d\.kernel$")


def _entry(path: tuple, shape: tuple, dtype) -> Entry:
  name = ".".join(str(p) for p in path)
  mod, leaf = name.rsplit(".", 1)
  layer = path[2] if len(path) > 2 and path[:2] == ("model", "layers") else None
  aliases = {}
  if name == "model.embed_tokens.embedding":
    kind, hf, hf_shape = COPY, ["model.embed_tokens.weight"], shape
  elif leaf == "scale":
    kind, hf, hf_shape = COPY, [mod + ".weight"], shape
  elif _CONV.search(name):
    kind, hf, hf_shape = CONV, [mod + ".weight"], (shape[1], 1, shape[0])
  elif leaf == "kernel":
    kind, hf, hf_shape = LINEAR, [mod + ".weight"], tuple(reversed(shape))
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", hf[0])
    if m:  # transformers' save_pretrained spelling of a dense FFN
      aliases = {hf[0]: f"model.layers.{m[1]}.block_sparse_moe.{m[2]}.weight"}
  elif leaf == "A_log":
    kind, hf, hf_shape = A_LOG, [name], (1, 1, shape[0], 1)
  elif leaf in ("dt_bias", "e_score_correction_bias"):
    kind, hf, hf_shape = COPY, [name], shape
  elif mod.endswith(".experts") and leaf in ("w1", "w2", "w3"):
    kind, hf_shape = EXPERTS, (shape[2], shape[1])
    hf = [f"{mod}.{e}.{leaf}.weight" for e in range(shape[0])]
  else:
    raise LayoutError(f"model parameter {name} {shape} has no Hugging Face counterpart in the name table "
                      f"(model/hf/names.py; see model/README.md)")
  return Entry(name, path, tuple(shape), np.dtype(dtype), kind, tuple(hf), tuple(hf_shape), aliases, layer)


def parameter_table(abstract_params) -> list[Entry]:
  """The model's parameters in model order, each with its HF tensors.

  Args:
    abstract_params: the model's state (an `nnx.State` or its pure dict) of arrays or
      `jax.ShapeDtypeStruct`s, e.g. `nnx.state(model.loading.abstract_model(cfg))` (what
      `model.hf.convert.parameter_table(cfg)` passes), so the table always matches the model.
  """
  pure = nnx.to_pure_dict(abstract_params) if isinstance(abstract_params, nnx.State) else abstract_params
  out = []
  for kp, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
    path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)
    out.append(_entry(path, tuple(leaf.shape), leaf.dtype))
  return _model_order(out)


def _model_order(entries: list[Entry]) -> list[Entry]:
  # Embedding first, then layers in index order, then the final norm and lm_head (the HF file order).
  def key(e: Entry):
    if e.layer is not None:
      return (1, e.layer, e.name)
    return (0 if "embed_tokens" in e.name else 2, 0, e.name)
  return sorted(entries, key=key)


# ------------------------------------------------------------------------------------------------
# Array transforms (NumPy, exact: only transposes, reshapes, stacking and dtype casts)
# ------------------------------------------------------------------------------------------------

def to_model(entry: Entry, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """One HF tensor -> the model parameter as a C-contiguous array of `dtype` (not for `experts`:
  those are assembled with `stack_expert`)."""
  if entry.kind == EXPERTS:
    raise ValueError(f"{entry.name}: stack experts with stack_expert")
  a = array
  if entry.kind == LINEAR:
    a = a.T
  elif entry.kind == CONV:
    a = a[:, 0, :].T
  elif entry.kind == A_LOG:
    a = a.reshape(entry.shape)
  return np.ascontiguousarray(a, dtype=dtype)


def stack_expert(out: np.ndarray, e: int, a: np.ndarray) -> None:
  """Writes HF expert `e`'s weight `[I, d]` (or `[d, I]`) transposed into `out[e]` (casting)."""
  out[e] = a.T


def to_hf(entry: Entry, array: np.ndarray, dtype: np.dtype) -> Iterator[tuple[str, np.ndarray]]:
  """The model parameter -> `(hf_name, C-contiguous array of dtype)` pairs (E of them for experts)."""
  if entry.kind == EXPERTS:
    for e, name in enumerate(entry.hf_names):
      yield name, np.ascontiguousarray(array[e].T, dtype=dtype)
    return
  a = array
  if entry.kind == LINEAR:
    a = a.T
  elif entry.kind == CONV:
    a = a.T[:, None, :]
  elif entry.kind == A_LOG:
    a = a.reshape(entry.hf_shape)
  yield entry.hf_names[0], np.ascontiguousarray(a, dtype=dtype)


def read_hf_config(path: str | os.PathLike) -> dict:
  """Parses `path/config.json` (LayoutError naming the file when missing or not JSON)."""
  f = pathlib.Path(path) / "config.json"
  if not f.is_file():
    raise LayoutError(f"{f} does not exist (an HF checkpoint directory holds config.json beside the weights)")
  try:
    return json.loads(f.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise LayoutError(f"{f} is not valid JSON: {e}") from None
