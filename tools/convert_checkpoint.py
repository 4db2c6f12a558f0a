r"""Converts Hugging Face Kimi-Linear safetensors checkpoints to the project's checkpoint and back.

Usage:
  python -m tools.convert_checkpoint hf_model_path=HF_DIR output_path=DIR \
      [weight_dtype=auto|float32|bfloat16] [overwrite=false] [tokenizer_path=FILE]
  python -m tools.convert_checkpoint direction=to_hf load_parameters_path=DIR output_path=HF_DIR \
      [weight_dtype=auto|float32|bfloat16] [max_shard_size=5GB] [overwrite=false]

Keys:
  direction             to_orbax (default): HF directory -> project checkpoint (model/checkpointing.py:
                        config.json + Orbax params/, loadable with load_parameters_path=DIR).
                        to_hf: project checkpoint -> HF directory (config.json + model.safetensors, or
                        model-0000i-of-0000n.safetensors + model.safetensors.index.json) that
                        transformers' KimiLinearForCausalLM.from_pretrained loads.
  hf_model_path         to_orbax input: a directory with config.json and model.safetensors or
                        model.safetensors.index.json + shards. Pickles (.bin/.pt) are refused.
  load_parameters_path  to_hf input: a project checkpoint directory.
  output_path           the directory to create; written in a hidden temporary sibling and renamed into
                        place at the end, so a failure leaves nothing there.
  weight_dtype          auto (default): keep every tensor's stored dtype (bit-exact both ways); the
                        config's weight_dtype is the source's (config.json `dtype`/`torch_dtype`).
                        float32 / bfloat16: cast the weights to it; A_log, dt_bias and the router (weight, bias)
                        stay float32, as in the model.
  overwrite             true: replace an existing output directory of the same kind (a project
                        checkpoint, an HF directory with config.json, or an empty directory).
  tokenizer_path        to_orbax: a sentencepiece .model file to copy into the checkpoint (optional).
  max_shard_size        to_hf: bytes per safetensors shard (units B, KB, MB, GB; decimal); default 5GB.

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
independent of the model size (tools/benchmark_convert.py measures it). to_hf reads the Orbax
checkpoint piece by piece and streams each safetensors shard to disk the same way.

Errors (a one-line message naming the tensor, file or key; exit status 2; nothing written): a missing or
unexpected tensor, a wrong shape, a dtype that is not a float (or cannot be cast), a truncated or
corrupt safetensors file, an unknown, unsupported or self-contradicting config.json.
Running out of memory (XLA's RESOURCE_EXHAUSTED) is one line too, `error: out of memory (<XLA's first
line>): ...`, exit status 2, nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

from model import checkpointing as ck
from model.config import ConfigError, apply_overrides
from model.tokenizer import TokenizerError, check_tokenizer_fits, load_tokenizer
from tools import hf_layout as hl
from tools.cli_args import parse_key_values

PIECE_BYTES = 256 * 2**20  # parameters handed to Orbax per write (bounded host memory)
DIRECTIONS = ("to_orbax", "to_hf")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HF_CONFIG_FILE = "hf_config.json"  # to_orbax: the source's config.json, kept for to_hf
KEYS = ("direction", "hf_model_path", "load_parameters_path", "output_path", "weight_dtype", "overwrite",
        "tokenizer_path", "max_shard_size")


class ConversionError(ValueError):
  """Bad arguments or input; printed as one line without a traceback."""


@dataclasses.dataclass(frozen=True)
class Args:
  direction: str = "to_orbax"
  hf_model_path: str = ""
  load_parameters_path: str = ""
  output_path: str = ""
  weight_dtype: str = "auto"
  overwrite: bool = False
  tokenizer_path: str = ""
  max_shard_size: int = 5 * 10**9


def _parse_size(text: str) -> int:
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
  if not m:
    raise ConversionError(f"max_shard_size expects a size like 300KB, 500MB or 5GB, got {text!r}")
  unit = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[m[2]]
  size = int(float(m[1]) * unit)
  if size < 1:
    raise ConversionError(f"max_shard_size must be positive, got {text!r}")
  return size


def parse_args(argv: Sequence[str]) -> Args:
  """`key=value` strings -> Args (ConversionError naming the argument and what was expected)."""
  raw = {k: v.strip() for k, v in parse_key_values(argv, KEYS, ConversionError).items()}
  direction = raw.get("direction", "to_orbax")
  if direction not in DIRECTIONS:
    raise ConversionError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
  wd = raw.get("weight_dtype", "auto")
  if wd not in WEIGHT_DTYPES:
    raise ConversionError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {wd!r}")
  ow = raw.get("overwrite", "false").lower()
  if ow not in ("true", "false"):
    raise ConversionError(f"overwrite must be true or false, got {raw['overwrite']!r}")
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
  size = _parse_size(raw["max_shard_size"]) if "max_shard_size" in raw else Args.max_shard_size
  return Args(direction=direction, hf_model_path=raw.get("hf_model_path", ""),
              load_parameters_path=raw.get("load_parameters_path", ""), output_path=raw["output_path"],
              weight_dtype=wd, overwrite=ow == "true", tokenizer_path=raw.get("tokenizer_path", ""),
              max_shard_size=size)


# ------------------------------------------------------------------------------------------------
# Reading HF safetensors
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: pathlib.Path
  dtype: str  # safetensors code, e.g. "BF16"
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    item = hl.ST_TO_NP[self.dtype].itemsize if self.dtype in hl.ST_TO_NP else 1
    return int(np.prod(self.shape)) * item


def _safe_open(file: pathlib.Path):
  from safetensors import safe_open
  try:
    return safe_open(os.fspath(file), framework="numpy")
  except Exception as e:  # SafetensorError, OSError: header or size inconsistent with the file
    raise ConversionError(f"{file}: not a readable safetensors file ({e}); is it truncated or corrupt?") from None


class SafetensorsSource:
  """The tensors of an HF checkpoint directory: names, dtypes and shapes from the headers only.

  Args:
    root: directory with `model.safetensors`, or `model.safetensors.index.json` and its shards.

  Raises:
    ConversionError: no safetensors (pickles are named and refused), a missing shard, an index that
      disagrees with the shards, a corrupt or truncated file, a tensor in two files.
  """

  def __init__(self, root: str | os.PathLike):
    self.root = pathlib.Path(root)
    if not self.root.is_dir():
      raise ConversionError(f"hf_model_path {os.fspath(root)!r} is not a directory")
    index = self.root / "model.safetensors.index.json"
    listed: dict[str, str] = {}
    if index.is_file():
      try:
        listed = json.loads(index.read_text())["weight_map"]
        if not isinstance(listed, dict):
          raise TypeError("weight_map is not an object")
      except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
      files = sorted(set(listed.values()))
    elif (self.root / "model.safetensors").is_file():
      files = ["model.safetensors"]
    else:
      files = sorted(p.name for p in self.root.glob("*.safetensors"))
      if not files:
        pickles = sorted(p.name for p in self.root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
          raise ConversionError(f"{self.root} holds only pickle checkpoints {pickles[:3]}; these are refused "
                                f"(unpickling runs arbitrary code): convert them to safetensors first")
        raise ConversionError(f"{self.root} holds no model.safetensors, model.safetensors.index.json or "
                              f"*.safetensors file")
    self.info: dict[str, TensorInfo] = {}
    for name in files:
      f = self.root / name
      if pathlib.Path(name).suffix in PICKLE_SUFFIXES or not name.endswith(".safetensors"):
        raise ConversionError(f"{index}: lists {name!r}, not a .safetensors file (pickles are refused)")
      if not f.is_file():
        raise ConversionError(f"shard {f} listed in {index.name} does not exist")
      with _safe_open(f) as h:
        for key in h.keys():
          sl = h.get_slice(key)
          if key in self.info:
            raise ConversionError(f"tensor {key} appears in both {self.info[key].file.name} and {name}")
          self.info[key] = TensorInfo(f, sl.get_dtype(), tuple(int(d) for d in sl.get_shape()))
    for key, name in listed.items():
      if key not in self.info:
        raise ConversionError(f"{index.name} lists tensor {key} in {name}, which does not contain it")
      if self.info[key].file.name != name:
        raise ConversionError(f"{index.name} lists tensor {key} in {name}, but it is in {self.info[key].file.name}")

  def read(self, name: str) -> np.ndarray:
    """One tensor as a NumPy array (a copy; the file is unmapped again afterwards)."""
    info = self.info[name]
    with _safe_open(info.file) as h:
      try:
        return h.get_tensor(name)
      except Exception as e:
        raise ConversionError(f"{info.file}: cannot read tensor {name} ({e})") from None


def _resolve(entries: list[hl.Entry], src: SafetensorsSource) -> dict[str, str]:
  """Maps every needed HF name to the name present in the source; checks names, shapes, dtypes.

  Raises:
    ConversionError: missing, unexpected, wrong-shape or non-float tensors (named with their file).
  """
  use, missing = {}, []
  for e in entries:
    for n in e.hf_names:
      alias = e.aliases.get(n)
      if n in src.info:
        use[n] = n
      elif alias in src.info:
        use[n] = alias
      else:
        missing.append((n, e))
  if missing:
    n, e = missing[0]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ConversionError(f"missing tensor {n} {list(e.hf_shape)} (for model parameter {e.name}){more} in "
                          f"{src.root}")
  unexpected = sorted(set(src.info) - set(use.values()))
  if unexpected:
    more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    raise ConversionError(f"unexpected tensor {unexpected[0]} in {src.info[unexpected[0]].file.name}{more}: "
                          f"the config describes no such parameter")
  for e in entries:
    for n in e.hf_names:
      info = src.info[use[n]]
      if info.shape != e.hf_shape:
        raise ConversionError(f"tensor {use[n]} in {info.file.name} has shape {list(info.shape)}, expected "
                              f"{list(e.hf_shape)} (from config.json)")
      if info.dtype not in hl.ST_TO_NP:
        raise ConversionError(f"tensor {use[n]} in {info.file.name} has dtype {info.dtype}, which cannot be "
                              f"converted (float tensors only: {', '.join(hl.ST_TO_NP)})")
  return use


def _source_weight_dtype(hf_cfg: dict, src: SafetensorsSource) -> str:
  """float32 or bfloat16: config.json's dtype, else the dtype holding most bytes."""
  named = hl.source_dtype(hf_cfg)
  if named in hl.MODEL_DTYPES:
    return named
  by_bytes: dict[str, int] = {}
  for info in src.info.values():
    by_bytes[info.dtype] = by_bytes.get(info.dtype, 0) + info.nbytes
  top = max(by_bytes, key=by_bytes.get) if by_bytes else "F32"
  return "bfloat16" if top == "BF16" else "float32"


def _stored_dtype(entry: hl.Entry, src_dtype: str, explicit: bool) -> np.dtype:
  """Explicit weight_dtype: the model's dtype. auto: the source's (float16/float64 widen/narrow to
  float32, since only float32/bfloat16 are model dtypes)."""
  if explicit:
    return entry.dtype
  d = hl.ST_TO_NP[src_dtype]
  return d if d in (np.dtype(np.float32), hl.MODEL_DTYPES["bfloat16"]) else np.dtype(np.float32)


# ------------------------------------------------------------------------------------------------
# to_orbax
# ------------------------------------------------------------------------------------------------

def _progress(total: int, desc: str):
  from tqdm import tqdm
  return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
              dynamic_ncols=True, mininterval=0.5)


def _nest(tree: dict, path: tuple, value) -> None:
  node = tree
  for k in path[:-1]:
    node = node.setdefault(k, {})
  node[path[-1]] = value


def hf_to_orbax(args: Args) -> dict:
  """Converts `args.hf_model_path` to a project checkpoint at `args.output_path`; returns a summary."""
  t0 = time.perf_counter()
  src_root = pathlib.Path(args.hf_model_path)
  if not src_root.is_dir():
    raise ConversionError(f"hf_model_path {args.hf_model_path!r} is not a directory")
  ck.check_writable(args.output_path, args.overwrite)
  hf_cfg = hl.read_hf_config(src_root)
  if args.tokenizer_path and not os.path.isfile(args.tokenizer_path):
    raise ConversionError(f"tokenizer_path {args.tokenizer_path!r} is not a file")
  src = SafetensorsSource(src_root)
  explicit = args.weight_dtype != "auto"
  wd = args.weight_dtype if explicit else _source_weight_dtype(hf_cfg, src)
  cfg, ignored = hl.config_from_hf(hf_cfg, name=src_root.absolute().name, weight_dtype=wd)
  if ignored:
    print(f"note: config.json keys not used by the model: {', '.join(ignored)}", file=sys.stderr)
  if args.tokenizer_path:  # a copied tokenizer must be one the model can use: checked before anything is written
    try:
      check_tokenizer_fits(load_tokenizer(args.tokenizer_path), cfg, name=f"tokenizer_path={args.tokenizer_path!r}",
                           advise=False)
    except TokenizerError as e:
      raise ConversionError(f"{e} (of hf_model_path's config.json): give the tokenizer made for this model") from None
  entries = hl.parameter_table(cfg)
  use = _resolve(entries, src)
  total = sum(src.info[use[n]].nbytes for e in entries for n in e.hf_names)

  n_tensors = 0
  with ck.ParameterWriter(args.output_path, cfg, tokenizer_path=args.tokenizer_path or None,
                          overwrite=args.overwrite) as writer, _progress(total, "to_orbax") as bar:
    (writer.tmp / HF_CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
    piece, piece_bytes = {}, 0
    for e in entries:
      if piece and piece_bytes + e.nbytes > PIECE_BYTES:
        writer.write(piece)
        piece, piece_bytes = {}, 0
      names = [use[n] for n in e.hf_names]
      dtype = _stored_dtype(e, src.info[names[0]].dtype, explicit)
      if e.kind == hl.EXPERTS:  # stack expert by expert: only the stack and one expert are in memory
        arr = np.empty(e.shape, dtype)
        for i, n in enumerate(names):
          hl.stack_expert(arr, i, src.read(n))
          bar.update(src.info[n].nbytes)
      else:
        arr = hl.to_model(e, src.read(names[0]), dtype)
        bar.update(src.info[names[0]].nbytes)
      n_tensors += len(names)
      _nest(piece, e.path, arr)
      piece_bytes += arr.nbytes
    if piece:
      writer.write(piece)
  seconds = time.perf_counter() - t0
  return {"direction": "to_orbax", "tensors": n_tensors, "parameters": len(entries), "bytes_read": total,
          "bytes_written": writer.bytes_written, "seconds": seconds, "output": os.fspath(writer.path),
          "weight_dtype": wd}


# ------------------------------------------------------------------------------------------------
# to_hf
# ------------------------------------------------------------------------------------------------

class _ShardWriter:
  """Streams tensors into one safetensors file whose header (names, dtypes, shapes) is known upfront.

  Format (github.com/huggingface/safetensors): u64 little-endian header length, the JSON header
  (`{name: {dtype, shape, data_offsets: [begin, end]}}` + `__metadata__`, space-padded to a multiple
  of 8 bytes), then the tensors' bytes back to back in header order.
  """

  def __init__(self, path: pathlib.Path, plan: list[tuple[str, tuple, np.dtype]]):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in plan:
      n = int(np.prod(shape)) * dtype.itemsize
      header[name] = {"dtype": hl.NP_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
      offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    self.expected = [(name, tuple(shape), dtype) for name, shape, dtype in plan]
    self.f = open(path, "wb")
    self.f.write(len(raw).to_bytes(8, "little") + raw)
    self.i = 0

  def write(self, name: str, array: np.ndarray) -> None:
    want = self.expected[self.i]
    if (name, tuple(array.shape), array.dtype) != want:  # a planning bug, never user input
      raise AssertionError(f"shard writer expected {want}, got {(name, array.shape, array.dtype)}")
    self.f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # raw bytes, no copy
    self.i += 1

  def close(self) -> None:
    self.f.close()
    if self.i != len(self.expected):
      raise AssertionError(f"shard closed after {self.i} of {len(self.expected)} tensors")


def _plan_shards(tensors: list[tuple[str, tuple, np.dtype]], max_bytes: int) -> list[list[tuple]]:
  shards, cur, size = [], [], 0
  for t in tensors:
    n = int(np.prod(t[1])) * t[2].itemsize
    if cur and size + n > max_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(t)
    size += n
  if cur:
    shards.append(cur)
  return shards


def _is_hf_dir(path: pathlib.Path) -> bool:
  return (path / "config.json").is_file() and not (path / ck.PARAMS_DIR).exists()


def orbax_to_hf(args: Args) -> dict:
  """Converts the project checkpoint `args.load_parameters_path` to an HF directory at `output_path`."""
  t0 = time.perf_counter()
  ck.check_writable(args.output_path, args.overwrite, _is_hf_dir, "an HF checkpoint")
  cfg = ck.read_config(args.load_parameters_path)
  stored = ck.stored_parameters(args.load_parameters_path)
  explicit = args.weight_dtype != "auto"
  if explicit:
    cfg = apply_overrides(cfg, [f"weight_dtype={args.weight_dtype}"])
  entries = hl.parameter_table(cfg)
  have, want = set(stored), {e.name for e in entries}
  if have != want:
    missing, extra = sorted(want - have), sorted(have - want)
    raise ConversionError(f"{args.load_parameters_path}: parameters do not match its config.json: missing "
                          f"{missing[:3]}, unexpected {extra[:3]}")
  out_dtype = {}
  for e in entries:
    if stored[e.name][0] != e.shape:
      raise ConversionError(f"{args.load_parameters_path}: parameter {e.name} is stored with shape "
                            f"{list(stored[e.name][0])}, config.json implies {list(e.shape)}")
    out_dtype[e.name] = e.dtype if explicit else np.dtype(stored[e.name][1])
    if out_dtype[e.name] not in hl.NP_TO_ST:
      raise ConversionError(f"parameter {e.name} has dtype {out_dtype[e.name]}, which safetensors output does "
                            f"not support here")
  tensors = [(n, e.hf_shape, out_dtype[e.name]) for e in entries for n in e.hf_names]
  label = majority_dtype(tensors)
  hf_cfg = merge_hf_config(hl.config_to_hf(cfg, dtype=label),
                           _stored_hf_config(pathlib.Path(args.load_parameters_path)), label)
  shards = _plan_shards(tensors, args.max_shard_size)
  nshard = len(shards)
  names = (["model.safetensors"] if nshard == 1 else
           [f"model-{i + 1:05d}-of-{nshard:05d}.safetensors" for i in range(nshard)])
  total = sum(int(np.prod(s)) * d.itemsize for _, s, d in tensors)

  with ck.atomic_directory(args.output_path, overwrite=args.overwrite, replaceable=_is_hf_dir,
                           what="an HF checkpoint") as tmp, _progress(total, "to_hf") as bar:
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    weight_map = {}
    shard_iter = iter(zip(names, shards))
    writer, left = None, 0
    for group in _read_groups(entries):
      arrays = ck.read_parameters(args.load_parameters_path, [e.name for e in group])
      for e in group:
        for hf_name, arr in hl.to_hf(e, arrays.pop(e.name), out_dtype[e.name]):
          if left == 0:
            if writer is not None:
              writer.close()
            fname, plan = next(shard_iter)
            writer, left = _ShardWriter(tmp / fname, plan), len(plan)
          writer.write(hf_name, arr)
          weight_map[hf_name] = fname
          left -= 1
          bar.update(arr.nbytes)
    writer.close()
    if nshard > 1:
      index = {"metadata": {"total_size": total}, "weight_map": weight_map}
      (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
  seconds = time.perf_counter() - t0
  return {"direction": "to_hf", "tensors": len(tensors), "parameters": len(entries), "bytes_read": total,
          "bytes_written": total, "seconds": seconds, "output": os.fspath(pathlib.Path(args.output_path).absolute()),
          "shards": nshard, "weight_dtype": label}


def majority_dtype(tensors: Sequence[tuple[str, tuple, np.dtype]]) -> str:
  """The name ("float32", "bfloat16", ...) of the dtype holding the most bytes among `(name, shape,
  dtype)` tensors (ties: the first met): the dtype an HF config.json reports for a mixed checkpoint."""
  size: dict[np.dtype, int] = {}
  for _, shape, dtype in tensors:
    size[dtype] = size.get(dtype, 0) + int(np.prod(shape)) * dtype.itemsize
  best = max(size, key=size.get)
  return "bfloat16" if best == np.dtype(hl.MODEL_DTYPES["bfloat16"]) else np.dtype(best).name


def merge_hf_config(ours: dict, source: dict | None, dtype: str) -> dict:
  """`source` (the original HF config.json, or None) updated with every key of `ours` (the keys the
  model defines win; nested dicts such as linear_attn_config are merged key by key), with `dtype` as
  its dtype (and torch_dtype, when the source has that key). Key order: the source's, then new keys."""
  def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
      out[k] = merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return out
  out = merge(source or {}, ours)
  out["dtype"] = dtype
  if "torch_dtype" in out:
    out["torch_dtype"] = dtype
  return out


def _stored_hf_config(ckpt: pathlib.Path) -> dict | None:
  """The source HF config.json that to_orbax kept in checkpoint `ckpt`, or None (e.g. a checkpoint
  written by tools.train). Raises ConversionError naming the file when it is not a JSON object."""
  f = ckpt / HF_CONFIG_FILE
  if not f.is_file():
    return None
  try:
    data = json.loads(f.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConversionError(f"{f} is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise ConversionError(f"{f} must hold a JSON object (the source HF config.json)")
  return data


def _read_groups(entries: list[hl.Entry]):
  """Consecutive entries in pieces of at most PIECE_BYTES (a larger parameter alone)."""
  group, size = [], 0
  for e in entries:
    if group and size + e.nbytes > PIECE_BYTES:
      yield group
      group, size = [], 0
    group.append(e)
    size += e.nbytes
  if group:
    yield group


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def convert(argv: Sequence[str]) -> dict:
  """Runs one conversion from `key=value` arguments; returns the summary dict.

  Raises:
    ConversionError, ck.CheckpointError, hl.LayoutError, ConfigError: bad arguments or input (named).
  """
  args = parse_args(argv)
  return hf_to_orbax(args) if args.direction == "to_orbax" else orbax_to_hf(args)


def _summary_line(s: dict) -> str:
  gb = s["bytes_read"] / 1e9
  rate = gb / s["seconds"] if s["seconds"] > 0 else float("inf")
  extra = f", {s['shards']} shard(s)" if "shards" in s else ""
  return (f"{s['direction']}: {s['tensors']} HF tensors <-> {s['parameters']} parameters, {gb:.3f} GB "
          f"({s['weight_dtype']}{extra}) in {s['seconds']:.1f} s ({rate:.2f} GB/s) -> {s['output']}")


def out_of_memory_advice() -> str:
  """What to do when XLA runs out of memory during a conversion (no key sizes it: tensors are read one
  at a time): on an accelerator, convert on the host (JAX_PLATFORMS=cpu); always, nothing was written."""
  import jax
  where = ("run it with JAX_PLATFORMS=cpu (the conversion needs no accelerator; host memory is larger)"
           if jax.default_backend() != "cpu" else "run it on a machine with more memory (the largest tensor, "
           "e.g. one layer's stacked experts, must fit)")
  return f"{where}; nothing was written to the output path"


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help", "help") for a in argv):
    print(__doc__)
    return 0
  try:
    summary = convert(argv)
  except (ConversionError, ck.CheckpointError, hl.LayoutError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # disk full, permissions: the output was rolled back
    print(f"error: {e.strerror or e} ({e.filename or ''}); nothing was written to the output path",
          file=sys.stderr)
    return 1
  except Exception as e:  # XLA's RESOURCE_EXHAUSTED (an Orbax read onto the device): one line; the output was rolled back
    from tools.serving_common import out_of_memory_message
    msg = out_of_memory_message(e, out_of_memory_advice())
    if msg is None:
      raise
    print(f"error: {msg}", file=sys.stderr)
    return 2
  print(_summary_line(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
