r"""Converts Hugging Face Kimi-Linear safetensors checkpoints to the project's checkpoint and back.

Usage:
  python -m tools.convert_checkpoint hf_model_path=HF_DIR output_path=DIR \
      [weight_dtype=auto|float32|bfloat16] [overwrite=false] [tokenizer_path=FILE|DIR|none] [allow_non_finite=false]
  python -m tools.convert_checkpoint direction=to_hf load_parameters_path=DIR output_path=HF_DIR \
      [weight_dtype=auto|float32|bfloat16] [max_shard_size=5GB] [overwrite=false]

Keys:
  direction             to_orbax (default): HF directory -> project checkpoint (model/checkpoint/format.py:
                        config.json + Orbax params/, loadable with load_parameters_path=DIR).
                        to_hf: project checkpoint -> HF directory (config.json + model.safetensors, or
                        model-0000i-of-0000n.safetensors + model.safetensors.index.json) that
                        transformers' KimiLinearForCausalLM.from_pretrained loads.
  hf_model_path         to_orbax input: a directory with config.json and model.safetensors or
                        model.safetensors.index.json + shards. Pickles (.bin/.pt) are refused.
  load_parameters_path  to_hf input: a project checkpoint directory.
  output_path           the directory to create; written in a hidden temporary sibling and renamed into
                        place at the end, so a failure leaves nothing there.
  weight_dtype          auto (default): keep every tensor's stored dtype, F16, BF16, F32 or F64 (bit-exact
                        both ways); the config's weight_dtype (the compute dtype the model casts the
                        parameters to when it loads them) is the source's config.json `dtype`/`torch_dtype`
                        when that is float32 or bfloat16, else bfloat16 for mostly-BF16 weights and float32
                        otherwise (F16 and F64 are cast to it at load time, never on disk).
                        float32 / bfloat16: cast the weights to it; A_log, dt_bias and the router (weight, bias)
                        stay float32, as in the model. The summary line says how many tensors were cast.
  overwrite             true: replace an existing output directory of the same kind (a project
                        checkpoint, an HF directory with config.json, or an empty directory).
  tokenizer_path        to_orbax: the tokenizer to copy into the checkpoint: a sentencepiece .model file
                        (stored as DIR/tokenizer.model) or a Kimi tokenizer directory (tiktoken.model +
                        tokenizer_config.json). Default: hf_model_path's own tokenizer when it holds one
                        (tiktoken.model: a Kimi checkpoint), else none; `none`: no tokenizer.
  max_shard_size        to_hf: bytes per safetensors shard (units B, KB, MB, GB; decimal); default 5GB.
  allow_non_finite      false (default): a tensor holding a NaN or an infinity is refused (one line naming
                        the first such tensor); true: convert it anyway, for debugging.

Tokenizer: to_orbax copies a Kimi tokenizer's files byte for byte into DIR/tokenizer/ (tiktoken.model,
tokenizer_config.json with its chat template, and generation_config.json, special_tokens_map.json,
chat_template.jinja, tokenization_*.py when present), lists their CRC-32 in DIR/checksums.json and
stores tokenizer_path=tokenizer in DIR/config.json: tools.generate (chat=true), tools.perplexity and
tools.serve (POST /v1/chat/completions) then find the tokenizer and chat template from
load_parameters_path=DIR alone. The tokenizer must fit the model (vocabulary size, bos/eos/pad ids),
checked before anything is written. to_hf writes those files back into the HF directory, byte for
byte (each checked against its checksum first).

HF config.json: to_orbax stores the source's config.json unchanged as DIR/hf_config.json. to_hf
writes the keys the model defines (shapes, layer layout, special ids, ...) from DIR/config.json and
keeps every other key of DIR/hf_config.json when there is one (informational keys such as
model_max_length, linear_num_heads, head_dim, qk_head_dim, transformers_version). Its `dtype` (and
`torch_dtype`, when the source config has that key) is the dtype holding the most parameter bytes of
the written tensors: "bfloat16" for bf16 matrices with float32 vectors (A_log, dt_bias, router),
which is how transformers labels such a file.

What a round trip (to_orbax, then to_hf, weight_dtype=auto) preserves:
  tensor values     bit-exact (same dtype, same bytes).
  tensor names      transformers' Kimi-Linear spelling, which may differ from the source's: e.g. a
                    dense FFN layer is written as `mlp.*` even when the source named it
                    `block_sparse_moe.*` (an alias to_orbax accepts).
  config.json       the source's keys and values, plus the keys the model needs that the source left
                    to their defaults (mla_use_nope, moe_layer_freq, moe_router_activation_func,
                    use_grouped_topk, num_nextn_predict_layers, ...); so it is not byte-identical.

Memory: tensors are read one at a time from the memory-mapped safetensors (each file is opened only for
the read, so its pages do not stay mapped) and written to Orbax in pieces of at most ~256 MB (one
stacked expert array may be larger), so peak host memory is about the largest tensor plus that piece,
independent of the model size (tools/bench/benchmark_convert.py measures it). to_hf reads the Orbax
checkpoint piece by piece and streams each safetensors shard to disk the same way.

Errors (a one-line message naming the tensor, file or key; exit status 2; nothing written): a missing or
unexpected tensor, a wrong shape, a dtype that is not a float (or cannot be cast), a truncated or
corrupt safetensors file, a NaN or infinity in a tensor (unless allow_non_finite=true), an unknown,
unsupported or self-contradicting config.json.
Running out of memory (XLA's RESOURCE_EXHAUSTED) is one line too, `error: out of memory (<XLA's first
line>): ...`, exit status 2, nothing written.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import jax

from model.hf.convert import DIRECTIONS, WEIGHT_DTYPES, ConversionError, ConvertArgs, hf_to_orbax, orbax_to_hf
from tools import cli

KEYS = ("direction", "hf_model_path", "load_parameters_path", "output_path", "weight_dtype", "overwrite",
        "tokenizer_path", "max_shard_size", "allow_non_finite")


def _parse_size(text: str) -> int:
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
  if not m:
    raise ConversionError(f"max_shard_size expects a size like 300KB, 500MB or 5GB, got {text!r}")
  unit = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[m[2]]
  size = int(float(m[1]) * unit)
  if size < 1:
    raise ConversionError(f"max_shard_size must be positive, got {text!r}")
  return size


def parse_args(argv: Sequence[str]) -> ConvertArgs:
  """`key=value` strings -> ConvertArgs (ConversionError naming the argument and what was expected)."""
  raw = {k: v.strip() for k, v in cli.parse_key_values(argv, KEYS, ConversionError).items()}
  direction = raw.get("direction", "to_orbax")
  if direction not in DIRECTIONS:
    raise ConversionError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
  wd = raw.get("weight_dtype", "auto")
  if wd not in WEIGHT_DTYPES:
    raise ConversionError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {wd!r}")
  ow = raw.get("overwrite", "false").lower()
  if ow not in ("true", "false"):
    raise ConversionError(f"overwrite must be true or false, got {raw['overwrite']!r}")
  anf = raw.get("allow_non_finite", "false").lower()
  if anf not in ("true", "false"):
    raise ConversionError(f"allow_non_finite must be true or false, got {raw['allow_non_finite']!r}")
  if not raw.get("output_path"):
    raise ConversionError("missing required argument output_path=DIR (see --help)")
  if direction == "to_orbax":
    if not raw.get("hf_model_path"):
      raise ConversionError("missing required argument hf_model_path=DIR (the HF checkpoint to convert)")
    for k in ("load_parameters_path", "max_shard_size"):
      if k in raw:
        raise ConversionError(f"{k} applies to direction=to_hf only")
  else:
    if not raw.get("load_parameters_path"):
      raise ConversionError("direction=to_hf needs load_parameters_path=DIR (the project checkpoint to convert); "
                            "output_path is the HF directory to write")
    for k in ("hf_model_path", "tokenizer_path"):
      if k in raw:
        raise ConversionError(f"{k} applies to direction=to_orbax only (to_hf reads load_parameters_path and "
                              f"writes output_path)")
  size = _parse_size(raw["max_shard_size"]) if "max_shard_size" in raw else ConvertArgs.max_shard_size
  return ConvertArgs(direction=direction, hf_model_path=raw.get("hf_model_path", ""),
              load_parameters_path=raw.get("load_parameters_path", ""), output_path=raw["output_path"],
              weight_dtype=wd, overwrite=ow == "true", tokenizer_path=raw.get("tokenizer_path", ""),
              max_shard_size=size, allow_non_finite=anf == "true")



def convert(argv: Sequence[str]) -> dict:
  """Runs one conversion from `key=value` arguments; returns the summary dict.

  Raises:
    model.errors.UserError (ConversionError, CheckpointError, LayoutError, ConfigError): bad
      arguments or input (named).
  """
  args = parse_args(argv)
  return hf_to_orbax(args) if args.direction == "to_orbax" else orbax_to_hf(args)


def _summary_line(s: dict) -> str:
  gb = s["bytes_read"] / 1e9
  rate = s["bytes_read"] / s["seconds"] if s["seconds"] > 0 else float("inf")
  # A small checkpoint moves at MB/s; "0.00 GB/s" would say nothing.
  speed = f"{rate / 1e9:.2f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.1f} MB/s"
  extra = f", {s['shards']} shard(s)" if "shards" in s else ""
  if s.get("tokenizer"):
    extra += f", tokenizer: {len(s['tokenizer'])} file(s)"
  casts = s.get("casts") or {}
  dtypes = ("cast " + ", ".join(f"{n} tensor(s) {k.replace('->', ' -> ')}" for k, n in casts.items())
            if casts else "every tensor in its stored dtype")
  return (f"{s['direction']}: {s['tensors']} HF tensors <-> {s['parameters']} parameters, {gb:.3f} GB "
          f"({s['weight_dtype']}{extra}; {dtypes}) in {s['seconds']:.1f} s ({speed}) -> {s['output']}")


def out_of_memory_advice() -> str:
  """What to do when XLA runs out of memory during a conversion (no key sizes it: tensors are read one
  at a time): on an accelerator, convert on the host (JAX_PLATFORMS=cpu); always, nothing was written."""
  where = ("run it with JAX_PLATFORMS=cpu (the conversion needs no accelerator; host memory is larger)"
           if jax.default_backend() != "cpu" else "run it on a machine with more memory (the largest tensor, "
           "e.g. one layer's stacked experts, must fit)")
  return f"{where}; nothing was written to the output path"


def run(argv: list[str]) -> int:
  """Converts as the `key=value` arguments say and prints a one-line summary; returns the status."""
  try:
    summary = convert(argv)
  except OSError as e:  # disk full, permissions: the output was rolled back
    print(f"error: {e.strerror or e} ({e.filename or ''}); nothing was written to the output path",
          file=sys.stderr)
    return 1
  print(_summary_line(summary))
  return 0


main = cli.tool_main(run, __doc__, memory_advice=out_of_memory_advice)
command = cli.command(main)

if __name__ == "__main__":
  command()
