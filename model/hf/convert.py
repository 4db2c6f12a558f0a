"""Conversion between Hugging Face Kimi-Linear safetensors checkpoints and the project's checkpoint.

`hf_to_orbax(ConvertArgs(...))` streams an HF directory (one `model.safetensors` or shards with an
index) tensor by tensor into a project checkpoint (`model/checkpoint/format.py`); `orbax_to_hf`
writes one back in transformers' Kimi-Linear spelling. Names, shapes and the config mapping are
`model/hf/names.py`'s table (docs/checkpoints.md). What a round trip preserves, the
memory bound and the error contract are in the help of `tools/convert_checkpoint.py` (the command
line, `kda-convert`), which parses the arguments and calls these functions.
"""


from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence

import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm import tqdm

from model import loading
from model.atomic import atomic_directory, check_writable
from model.checkpoint import format as ck
from model.checkpoint import tokenizer_files
from model.checkpoint.checksums import check_files, non_finite
from model.data.chat_template import ChatTemplateError
from model.config import apply_overrides
from model.data.tokenizer import TokenizerError, check_tokenizer_fits, load_tokenizer
from model.errors import UserError
from model.hf import names as hl

PIECE_BYTES = 256 * 2**20  # parameters handed to Orbax per write (bounded host memory)
DIRECTIONS = ("to_orbax", "to_hf")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HF_CONFIG_FILE = "hf_config.json"  # to_orbax: the source's config.json, kept for to_hf


class ConversionError(UserError):
  """Bad arguments or input; printed as one line without a traceback."""


@dataclasses.dataclass(frozen=True)
class ConvertArgs:
  direction: str = "to_orbax"
  hf_model_path: str = ""
  load_parameters_path: str = ""
  output_path: str = ""
  weight_dtype: str = "auto"
  overwrite: bool = False
  tokenizer_path: str = ""
  max_shard_size: int = 5 * 10**9
  allow_non_finite: bool = False


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
        if (self.root / "params").is_dir() and (self.root / "config.json").is_file():
          raise ConversionError(f"hf_model_path={self.root} is a checkpoint of this project (config.json + params/), "
                                f"not a Hugging Face directory: to convert it to one, pass direction=to_hf "
                                f"load_parameters_path={self.root} output_path=DIR")
        raise ConversionError(f"hf_model_path={self.root} holds no model.safetensors, model.safetensors.index.json "
                              f"or *.safetensors file")
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

  def read(self, name: str, *, allow_non_finite: bool = False) -> np.ndarray:
    """One tensor as a NumPy array (a copy; the file is unmapped again afterwards).

    Raises:
      ConversionError: unreadable data, or (unless `allow_non_finite`) a NaN or an infinity in
        the tensor (one line naming the tensor, its file, the count and the first index).
    """
    info = self.info[name]
    with _safe_open(info.file) as h:
      try:
        arr = h.get_tensor(name)
      except Exception as e:
        raise ConversionError(f"{info.file}: cannot read tensor {name} ({e})") from None
    bad = None if allow_non_finite else non_finite(arr)
    if bad:
      raise ConversionError(f"tensor {name} in {info.file.name} holds {bad}; refusing to convert it "
                            f"(allow_non_finite=true converts it anyway, for debugging)")
    return arr


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
  """Explicit weight_dtype: the model's dtype (a cast). auto: exactly the source's dtype (F16, BF16,
  F32 or F64 are stored as such, bit for bit; loading casts them to the configured compute dtype,
  `weight_dtype`, see `model.checkpoint.format.restore_parameters`)."""
  return entry.dtype if explicit else hl.ST_TO_NP[src_dtype]


def _casts(pairs) -> dict[str, int]:
  """`{"F16->float32": n, ...}`: how many tensors an explicit weight_dtype changed, by (from, to)."""
  out: dict[str, int] = {}
  for src, dst in pairs:
    if np.dtype(src) != np.dtype(dst):
      key = f"{hl.NP_TO_ST[np.dtype(src)]}->{_dtype_name(dst)}"
      out[key] = out.get(key, 0) + 1
  return out


def _dtype_name(d) -> str:
  d = np.dtype(d)
  return "bfloat16" if d == hl.MODEL_DTYPES["bfloat16"] else d.name


# ------------------------------------------------------------------------------------------------
# to_orbax
# ------------------------------------------------------------------------------------------------

def parameter_table(cfg) -> list[hl.Entry]:
  """The HF <-> model table (`names.parameter_table`) of the model of `cfg`, built from its
  abstract parameters (`nnx.eval_shape`: no arrays allocated), so it always matches the model."""
  return hl.parameter_table(nnx.state(loading.abstract_model(cfg)))


def _progress(total: int, desc: str):
  return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
              dynamic_ncols=True, mininterval=0.5)


def _nest(tree: dict, path: tuple, value) -> None:
  node = tree
  for k in path[:-1]:
    node = node.setdefault(k, {})
  node[path[-1]] = value


def hf_to_orbax(args: ConvertArgs) -> dict:
  """Converts `args.hf_model_path` to a project checkpoint at `args.output_path`; returns a summary."""
  t0 = time.perf_counter()
  src_root = pathlib.Path(args.hf_model_path)
  if not src_root.is_dir():
    raise ConversionError(f"hf_model_path {args.hf_model_path!r} is not a directory")
  check_writable(args.output_path, args.overwrite, ck.is_checkpoint, "a checkpoint")
  hf_cfg = hl.read_hf_config(src_root)
  tokenizer = _source_tokenizer(args, src_root)
  src = SafetensorsSource(src_root)
  explicit = args.weight_dtype != "auto"
  wd = args.weight_dtype if explicit else _source_weight_dtype(hf_cfg, src)
  cfg, ignored = hl.config_from_hf(hf_cfg, name=src_root.absolute().name, weight_dtype=wd)
  if ignored:
    print(f"note: config.json keys not used by the model: {', '.join(ignored)}", file=sys.stderr)
  if tokenizer:  # a copied tokenizer must be one the model can use: checked before anything is written
    name = (f"tokenizer_path={tokenizer!r}" if args.tokenizer_path else
            f"in hf_model_path ({tokenizer!r}; tokenizer_path=none converts without it)")
    try:
      check_tokenizer_fits(load_tokenizer(tokenizer), cfg, name=name, advise=False)
    except ChatTemplateError as e:
      raise ConversionError(f"the tokenizer {name}: {e}") from None
    except TokenizerError as e:
      raise ConversionError(f"{e} (of hf_model_path's config.json): give the tokenizer made for this model") from None
  entries = parameter_table(cfg)
  use = _resolve(entries, src)
  total = sum(src.info[use[n]].nbytes for e in entries for n in e.hf_names)

  n_tensors, cast_pairs = 0, []
  with ck.ParameterWriter(args.output_path, cfg, tokenizer_path=tokenizer or None,
                          overwrite=args.overwrite) as writer, _progress(total, "to_orbax") as bar:
    writer.add_file(HF_CONFIG_FILE, (json.dumps(hf_cfg, indent=2) + "\n").encode())
    piece, piece_bytes = {}, 0
    for e in entries:
      if piece and piece_bytes + e.nbytes > PIECE_BYTES:
        writer.write(piece)
        piece, piece_bytes = {}, 0
      names = [use[n] for n in e.hf_names]
      dtype = _stored_dtype(e, src.info[names[0]].dtype, explicit)
      cast_pairs += [(hl.ST_TO_NP[src.info[n].dtype], dtype) for n in names]
      if e.kind == hl.EXPERTS:  # stack expert by expert: only the stack and one expert are in memory
        arr = np.empty(e.shape, dtype)
        for i, n in enumerate(names):
          hl.stack_expert(arr, i, src.read(n, allow_non_finite=args.allow_non_finite))
          bar.update(src.info[n].nbytes)
      else:
        arr = hl.to_model(e, src.read(names[0], allow_non_finite=args.allow_non_finite), dtype)
        bar.update(src.info[names[0]].nbytes)
      n_tensors += len(names)
      _nest(piece, e.path, arr)
      piece_bytes += arr.nbytes
    if piece:
      writer.write(piece)
  seconds = time.perf_counter() - t0
  return {"direction": "to_orbax", "tensors": n_tensors, "parameters": len(entries), "bytes_read": total,
          "bytes_written": writer.bytes_written, "seconds": seconds, "output": os.fspath(writer.path),
          "weight_dtype": wd, "casts": _casts(cast_pairs),
          "tokenizer": [name for _, name in writer.tokenizer_files]}


def _source_tokenizer(args: ConvertArgs, src_root: pathlib.Path) -> str:
  """The tokenizer to_orbax carries into the checkpoint: `tokenizer_path` when given (a sentencepiece
  file or a Kimi tokenizer directory; "none" for no tokenizer), else hf_model_path itself when it holds a
  Kimi tokenizer (tiktoken.model), else "" (none).

  Raises:
    ConversionError: a tokenizer_path that does not exist, or a directory without tiktoken.model and
      tokenizer_config.json.
  """
  given = args.tokenizer_path
  if given.lower() == "none":
    return ""
  if not given:
    return os.fspath(src_root) if tokenizer_files.is_tokenizer_dir(src_root) else ""
  if os.path.isdir(given):
    try:
      tokenizer_files.tokenizer_dir_files(given)
    except FileNotFoundError as e:
      raise ConversionError(f"tokenizer_path: {e}") from None
  elif not os.path.isfile(given):
    raise ConversionError(f"tokenizer_path {given!r} does not exist (expected a sentencepiece .model file or a "
                          f"Kimi tokenizer directory with tiktoken.model)")
  return given


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


def orbax_to_hf(args: ConvertArgs) -> dict:
  """Converts the project checkpoint `args.load_parameters_path` to an HF directory at `output_path`."""
  t0 = time.perf_counter()
  check_writable(args.output_path, args.overwrite, _is_hf_dir, "an HF checkpoint")
  cfg = loading.read_config(args.load_parameters_path)  # the one read of its config.json
  stored = ck.stored_parameters(args.load_parameters_path)
  explicit = args.weight_dtype != "auto"
  if explicit:
    cfg = apply_overrides(cfg, [f"weight_dtype={args.weight_dtype}"])
  entries = parameter_table(cfg)
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
  casts = _casts((stored[e.name][1], out_dtype[e.name]) for e in entries for _ in e.hf_names)
  label = majority_dtype(tensors)
  hf_cfg = merge_hf_config(hl.config_to_hf(cfg, dtype=label),
                           _stored_hf_config(pathlib.Path(args.load_parameters_path)), label)
  shards = _plan_shards(tensors, args.max_shard_size)
  nshard = len(shards)
  names = (["model.safetensors"] if nshard == 1 else
           [f"model-{i + 1:05d}-of-{nshard:05d}.safetensors" for i in range(nshard)])
  total = sum(int(np.prod(s)) * d.itemsize for _, s, d in tensors)

  with atomic_directory(args.output_path, overwrite=args.overwrite, replaceable=_is_hf_dir,
                        what="an HF checkpoint") as tmp, _progress(total, "to_hf") as bar:
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    weight_map = {}
    shard_iter = iter(zip(names, shards))
    writer, left = None, 0
    for group in _read_groups(entries):
      arrays = ck.read_parameters(args.load_parameters_path, [e.name for e in group])
      for name, arr in arrays.items():
        bad = None if args.allow_non_finite else non_finite(arr)
        if bad:
          raise ConversionError(f"parameter {name} of {args.load_parameters_path} holds {bad}; refusing to "
                                f"convert it (allow_non_finite=true converts it anyway, for debugging)")
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
    carried = _write_tokenizer_back(pathlib.Path(args.load_parameters_path), tmp)
  seconds = time.perf_counter() - t0
  return {"direction": "to_hf", "tensors": len(tensors), "parameters": len(entries), "bytes_read": total,
          "bytes_written": total, "seconds": seconds, "output": os.fspath(pathlib.Path(args.output_path).absolute()),
          "shards": nshard, "weight_dtype": label, "casts": casts, "tokenizer": carried}


def _write_tokenizer_back(ckpt: pathlib.Path, out: pathlib.Path) -> list[str]:
  """Copies the Kimi tokenizer checkpoint `ckpt` carries (DIR/tokenizer/) into the HF directory `out`,
  byte for byte, after checking each file against checksums.json; returns the names written."""
  src = ckpt / tokenizer_files.TOKENIZER_DIR
  if not src.is_dir():
    return []
  names = sorted(f.name for f in src.iterdir() if f.is_file())
  check_files(ckpt, [f"{tokenizer_files.TOKENIZER_DIR}/{n}" for n in names])
  for n in names:
    if (out / n).exists():
      raise ConversionError(f"{ckpt}: the tokenizer file {n} would overwrite the converted {n}")
    shutil.copyfile(src / n, out / n)
  return names


def majority_dtype(tensors: Sequence[tuple[str, tuple, np.dtype]]) -> str:
  """The name ("float32", "bfloat16", ...) of the dtype holding the most bytes among `(name, shape,
  dtype)` tensors (ties: the first met): the dtype an HF config.json reports for a mixed checkpoint."""
  size: dict[np.dtype, int] = {}
  for _, shape, dtype in tensors:
    size[dtype] = size.get(dtype, 0) + int(np.prod(shape)) * dtype.itemsize
  best = max(size, key=size.get)
  return _dtype_name(best)


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
