"""The training loop of `tools.train` (`kda-train`): data, steps, checkpoints, evaluation, export.

`train(cfg)` runs (or resumes) one run as the config says; the command line, its help and the
exit-status contract are `tools/train.py`'s, whose help describes what a run does (data split,
loss, optimizer, checkpoints and exact resume, evaluation, logs, export). The jitted steps, the
train state and its checkpointer are `model.training.steps`.
"""


from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from model import loading, memory, partitioning
from model.engine import compilation_cache
from model.training import compiled_step
from model.training import steps as train_lib
from model.checkpoint import format as checkpointing
from model.config import config_to_json, matmul_precision
from model.nn import moe
from model.errors import out_of_memory, out_of_memory_message
from model.data.pipeline import DataFormatError, DocumentTooLongError, make_eval_windows, make_train_iterator, \
    read_text_file, split_heldout
from model.data.tokenizer import TIKTOKEN_FILE, TokenizerError, check_tokenizer_fits, load_tokenizer
from model.training.steps import TrainError

CHECKPOINT_SUBDIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
PARAMS_SUBDIR = "params"
# What sizes the step and the evaluation: named in the one-line error when XLA runs out of memory.
MEMORY_KEYS = ("batch_size or seq_len (a step holds batch_size x seq_len tokens; evaluation eval_batch_size x "
               "seq_len)")
# The step's memory beyond its tokens: offered by `memory_advice` when the config does not use them yet.
REMAT_ADVICE = "each layer recomputes its activations in the backward"
MOE_ADVICE = "moe_impl=megablox on one TPU device or ragged elsewhere"
# Where the seconds of the last cold compile of a step are kept (in the persistent cache's directory): the
# next run's announcement quotes them.
COMPILE_TIMES_FILE = "kda-train-compile-seconds.json"


# ------------------------------------------------------------------------------------------------
# Set-up: config, tokenizer, data
# ------------------------------------------------------------------------------------------------

def _tokenizer(cfg):
  """The tokenizer of `tokenizer_path`, or ids-only (format "ids") built from the config's ids."""
  if cfg.tokenizer_path:
    name = f"tokenizer_path={cfg.tokenizer_path!r}"
    if not os.path.exists(cfg.tokenizer_path):
      raise TrainError(f"{name} does not exist: expected a sentencepiece .model file (tools.train_tokenizer writes "
                       f"one), or a directory with {TIKTOKEN_FILE} and tokenizer_config.json")
    try:
      tok = load_tokenizer(cfg.tokenizer_path)
    except TokenizerError as e:   # a directory without tiktoken.model, a file that is no tokenizer
      raise TrainError(f"{name}: {e}") from None
  elif cfg.train_data_format == "ids":
    tok = load_tokenizer(None, vocab_size=cfg.vocab_size, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id,
                         pad_id=cfg.pad_token_id)
  else:
    raise TrainError(f"tokenizer_path is required for train_data_format={cfg.train_data_format!r} (a "
                     f"sentencepiece .model from tools.train_tokenizer); only format 'ids' trains without one")
  try:
    check_tokenizer_fits(tok, cfg, name=f"tokenizer_path={cfg.tokenizer_path!r}" if cfg.tokenizer_path else None)
  except TokenizerError as e:
    raise TrainError(str(e)) from None
  return tok


def _check_corpus(cfg) -> None:
  """Clear errors for a missing path, a missing file, an empty corpus or an empty train split."""
  path = cfg.train_data
  if not path:
    raise TrainError("train_data is required: pass train_data=FILE (the corpus to train on)")
  if not os.path.exists(path):
    raise TrainError(f"train_data={path!r} does not exist")
  if not os.path.isfile(path):
    raise TrainError(f"train_data={path!r} is not a file")
  try:
    text = read_text_file(path)  # read once more by the pipeline; cheap next to training
  except DataFormatError as e:
    raise TrainError(f"train_data: {e}") from None
  if not text.strip():
    raise TrainError(f"train_data={path!r} is empty: it holds no documents (no non-blank text)")
  train, _ = split_heldout(text, cfg.heldout_fraction)
  if not train.strip():
    raise TrainError(f"the training split of train_data={path!r} is empty: the held-out rule "
                     f"(heldout_fraction={cfg.heldout_fraction}, cut at a line start) leaves no text to train on")


def _differs_from_checkpoint(cfg) -> str:
  """`"keys that differ from DIR/config.json: k=v (checkpoint: w), ...; "` for the model keys of `cfg`
  stored in its load_parameters_path checkpoint with another value, or "" (none, or no readable file)."""
  try:
    stored = json.loads(checkpointing.read_config_text(pathlib.Path(cfg.load_parameters_path)))
  except (OSError, ValueError):
    return ""
  diff = [f"{k}={cfg[k]!r} (checkpoint: {v!r})" for k, v in sorted(stored.items())
          if k in cfg and k not in ("load_parameters_path", "tokenizer_path") and cfg[k] != v
          and not (isinstance(cfg[k], tuple | list) and list(cfg[k]) == v)]
  return f"keys that differ from its config.json: {', '.join(diff)}; " if diff else ""


def build_data(cfg, tok):
  """`(BatchIterator over the train split, list of held-out EvalWindow)` for `cfg`."""
  _check_corpus(cfg)
  common = dict(heldout_fraction=cfg.heldout_fraction, max_segments=cfg.max_num_segments)
  try:
    it = make_train_iterator(cfg.train_data, cfg.train_data_format, tok, seq_len=cfg.seq_len,
                             batch_size=cfg.batch_size, seed=cfg.data_seed, split_long=cfg.split_long,
                             **common)
    windows = []
    if cfg.eval_every > 0:
      windows = make_eval_windows(cfg.train_data, cfg.train_data_format, tok, seq_len=cfg.seq_len,
                                  batch_size=cfg.eval_batch_size, **common)
  except DataFormatError as e:
    raise TrainError(f"train_data: {e}") from None
  except DocumentTooLongError as e:
    raise TrainError(f"train_data={cfg.train_data!r}: a document of {e.length} tokens (after framing) is longer "
                     f"than seq_len={e.seq_len}, and split_long='none' keeps documents whole; "
                     f"pass split_long=long or split_long=fill to cut long documents, or a larger seq_len") from None
  except ValueError as e:  # e.g. no packed rows
    raise TrainError(f"train_data={cfg.train_data!r}: {e}") from None
  if cfg.eval_every > 0 and not windows:
    raise TrainError(f"the held-out split of train_data={cfg.train_data!r} holds no tokens; raise "
                     f"heldout_fraction or pass eval_every=0")
  if cfg.eval_max_windows:
    windows = windows[:cfg.eval_max_windows]
  # How full the rows are: a row holds at most max_num_segments documents (the KDA state slots), so
  # short documents in long rows leave most of each row padding, which the step still computes.
  seg = it.rows.segment_ids
  filled = float(np.mean(seg > 0))
  at_cap = float(np.mean(seg.max(axis=1) >= cfg.max_num_segments))
  hint = ("; most rows hold the most documents a row may: raise max_num_segments or lower seq_len to pack "
          "more" if filled < 0.5 and at_cap > 0.5 else "")
  rows = f"{it.num_rows:,} packed row{'s' if it.num_rows != 1 else ''}"
  _say(f"train data: {rows} of seq_len={cfg.seq_len}, {filled:.0%} of their tokens from documents (at most "
       f"max_num_segments={cfg.max_num_segments} documents a row){hint}")
  return it, windows


# ------------------------------------------------------------------------------------------------
# Export and metrics
# ------------------------------------------------------------------------------------------------

def export_parameters(path, graphdef, state, cfg, *, overwrite: bool = True) -> pathlib.Path:
  """Writes the model's parameters to `path` in the project's checkpoint format (atomically).

  With export_dtype=bfloat16, floating arrays of ndim >= 2 (matrices, experts, embeddings) are
  stored in bfloat16; vectors (norm scales, A_log, dt_bias, router bias) stay float32. Loading
  casts back to the config's weight_dtype.
  """
  model = nnx.merge(graphdef, state["params"], state["rest"])
  mstate = nnx.state(model)
  if cfg.export_dtype == "bfloat16":
    mstate = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)
                          else x, mstate)
  return checkpointing.save_parameters(path, mstate, cfg, overwrite=overwrite)


class MetricsLog:
  """Appends JSON records to DIR/metrics.jsonl (one object per line, flushed at once).

  On resume, records of steps after the restored checkpoint (written by the interrupted run and
  about to be recomputed) are dropped first, via an atomic rewrite.
  """

  def __init__(self, path: pathlib.Path, resume_step: int):
    self.path = path
    if path.exists():
      keep = []
      for line in path.read_text().splitlines():
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut by a crash
        if rec.get("step", 0) <= resume_step:
          keep.append(line)
      tmp = path.with_name(path.name + ".tmp")
      tmp.write_text("".join(k + "\n" for k in keep))
      os.replace(tmp, path)
    self._f = open(path, "a")

  def write(self, record: dict) -> None:
    self._f.write(json.dumps(record) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------

def _meta(cfg, tok) -> dict:
  return {"config": json.loads(config_to_json(cfg)),
          "train_data_sha256": train_lib.file_sha256(cfg.train_data),
          "tokenizer_sha256": train_lib.file_sha256(getattr(tok, "path", None))}


def _check_resume(meta: dict, now: dict, ckpt_dir) -> None:
  bad = train_lib.resume_mismatches(meta.get("config", {}), now["config"])
  for key in ("train_data_sha256", "tokenizer_sha256"):
    if meta.get(key) != now[key]:
      what = "train_data file" if key.startswith("train") else "tokenizer file"
      bad.append(f"{what} content differs from the one the checkpoint was trained on")
  if bad:
    raise TrainError(f"cannot resume from {ckpt_dir}: the config does not match the checkpoint ("
                     + "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more" if len(bad) > 6 else "")
                     + "); use the original values or a new output_dir")


def is_run_directory(path: pathlib.Path) -> bool:
  """Whether directory `path` holds a run of this tool: its checkpoints/ directory or metrics.jsonl
  (the first things a run writes; an interrupted run that completed no step removes them again)."""
  return (path / CHECKPOINT_SUBDIR).is_dir() or (path / METRICS_FILE).is_file()


def check_output_dir(path: pathlib.Path, given: str, overwrite: bool) -> None:
  """Refuses an existing, non-empty `path` (output_dir=`given`) that is not a run directory of this
  tool (`is_run_directory`), unless `overwrite`; a new, empty or run directory passes.

  Raises:
    TrainError naming output_dir, a few of the entries found, and the two ways out.
  """
  if overwrite or not path.is_dir() or is_run_directory(path):
    return
  names = sorted(p.name for p in path.iterdir())
  if not names:
    return
  shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
  raise TrainError(f"output_dir={given!r} is not empty and is not a run directory of tools.train (no "
                   f"{CHECKPOINT_SUBDIR}/ or {METRICS_FILE}; it holds {shown}); choose a new or empty directory, "
                   f"or pass overwrite=true to write the run into it (nothing in it is deleted)")


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


class _Interrupts:
  """SIGTERM as KeyboardInterrupt, held back (`hold`) while a checkpoint is being written or a step is
  dispatched: a signal that lands in `ckpt.save` (Orbax writing, its threads mid-file) is raised once
  that checkpoint is complete, so a preempted run never leaves a half-written step behind, and one that
  lands while a step takes the donated train state is raised once the new state is bound, so the run
  can checkpoint it. A KeyboardInterrupt raised where Python discards exceptions (a gc callback, a
  __del__) would be lost: `check`, called once a step, raises it again."""

  def __init__(self):
    self.held = False
    self.pending = None
    self.received = None

  def handler(self, signum, frame):
    if self.held:
      self.pending = signum
      return
    self.received = signum   # cleared by `check` only: raised below, it may be swallowed
    _raise_interrupt(signum, frame)

  def check(self):
    """Raises a SIGTERM whose KeyboardInterrupt was swallowed."""
    if self.received is not None:
      signum, self.received = self.received, None
      _raise_interrupt(signum, None)

  @contextlib.contextmanager
  def hold(self):
    self.held = True
    try:
      yield
    finally:
      self.held = False
      if self.pending is not None:   # raised even when the held block failed: the interrupt wins
        signum, self.pending = self.pending, None
        self.received = None
        _raise_interrupt(signum, None)


def _remove_unused_run(out: pathlib.Path, created: bool) -> None:
  """Removes what a run that completed no step made: all of `out` when this run created it, else an
  empty checkpoints/ and an empty metrics file."""
  if created:
    shutil.rmtree(out, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      (out / CHECKPOINT_SUBDIR).rmdir()  # only when empty
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size == 0:
      metrics.unlink()


def _nothing_saved(out: pathlib.Path, created: bool, start: int | None) -> None:
  """Says (one line on stderr) that an interrupted run completed no step, and removes what it made
  (`_remove_unused_run`)."""
  _remove_unused_run(out, created)
  kept = f"; the checkpoint of step {start} is unchanged" if start else ""
  print(f"interrupted before the first training step finished: no step was completed and nothing was saved"
        f"{kept}", file=sys.stderr)


def memory_advice(cfg) -> str:
  """What to change when a step does not fit: `lower MEMORY_KEYS`, then remat_policy=full and a routed
  moe_impl where the config does not use them yet (one line, for the `out of memory (...)` errors)."""
  more = []
  if cfg.remat_policy not in ("full", "nothing_saveable"):   # the same jax policy (model/nn/scan.py)
    more.append(f"remat_policy=full (now {cfg.remat_policy}; {REMAT_ADVICE})")
  impl = moe.resolve_moe_impl(cfg.moe_impl)
  if impl == "dense" and cfg.num_experts:
    more.append(f"{MOE_ADVICE} (now {cfg.moe_impl}, dense here: every expert on every token)")
  return f"lower {MEMORY_KEYS}" + (f", or set {', '.join(more)}" if more else "")


def _compile_key(cfg, device, params: int) -> str:
  """What a step's compile time depends on, for the announcement's estimate (not a cache key)."""
  return "|".join(str(x) for x in (cfg.model_name, params, cfg.num_hidden_layers, cfg.batch_size, cfg.seq_len,
                                   cfg.dtype, cfg.weight_dtype, cfg.remat_policy, cfg.moe_impl, cfg.scan_layers,
                                   device.device_kind, jax.device_count(), jax.__version__))


def _compile_times(cache_dir) -> dict:
  try:
    return json.loads((pathlib.Path(cache_dir) / COMPILE_TIMES_FILE).read_text())
  except (OSError, ValueError, TypeError):
    return {}


def _record_compile_time(cache_dir, key: str, seconds: float) -> None:
  times = _compile_times(cache_dir)
  times[key] = round(seconds, 1)
  with contextlib.suppress(OSError):
    path = pathlib.Path(cache_dir) / COMPILE_TIMES_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(times, indent=0, sort_keys=True))
    os.replace(tmp, path)


def _say(line: str) -> None:
  tqdm.write(line, file=sys.stderr)
  sys.stderr.flush()


def step_header(cfg) -> dict:
  """What this run's train step is compiled for (`compiled_step.header`): checked against a
  compiled_trainstep_file."""
  n = jax.device_count()
  return compiled_step.header(cfg, jax.devices()[0].device_kind, n, partitioning.mesh_shape(cfg, n))


def check_step_memory(step_fn, state, batch, *, reuse: bool, cfg=None, aot_step: dict | None = None) -> dict | None:
  """Announces and compiles the train step, says how long it took, and refuses it before it runs when
  it cannot fit: libtpu refuses to compile it for memory (a TPU), or XLA's compile-time
  `memory_analysis()` says it needs more than the device has (its bytes_limit; on CPU the host's
  available memory). `reuse`: later steps run the executable compiled here (one device). `cfg` (the
  run's config) names the model and shapes in the announcement and the keys in the error.

  jax's persistent compilation cache (`model.engine.compilation_cache`, enabled by tools.train) makes a
  restart load the executable instead of compiling it; the seconds of a cold compile are kept beside
  the cache (COMPILE_TIMES_FILE) and quoted by the next run's announcement. With `aot_step` (the
  header of cfg.compiled_trainstep_file, `compiled_step.read` and checked), the step is loaded from
  that file instead, and every later step runs it.

  Returns:
    None for a step without an ahead-of-time form (a wrapped or substituted step), else
    {"seconds", "cache_dir", "cache_hits", "cache_requests", "loaded_from_cache", "need_bytes", "have_bytes",
    "device_kind"}.

  Raises:
    TrainError: `out of memory (a train step needs N MiB by ...; M MiB available): lower batch_size or
      seq_len ...; checked before the first step, nothing was run`.
  """
  compile_step = getattr(step_fn, "compile", None)
  if compile_step is None:  # a step without an ahead-of-time form (a wrapped or substituted step)
    return None
  device = jax.devices()[0]
  if aot_step is not None:
    return _load_step(step_fn, cfg, device)
  advice = memory_advice(cfg) if cfg is not None else f"lower {MEMORY_KEYS}"
  params = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"])))
  cache_dir = compilation_cache.directory()
  key = _compile_key(cfg, device, params) if cfg is not None else None
  last = _compile_times(cache_dir).get(key) if cache_dir and key else None
  if last is not None:
    estimate = f"this takes ~{last:.0f} s on a first run, as the last cold compile of this step here did"
  else:
    estimate = ("a first run compiles for seconds (a small model on a CPU) to minutes (a ~1B model on a TPU); "
                "a restart loads it from the cache")
  where = f"persistent cache at {cache_dir}" if cache_dir else "no persistent cache: compilation_cache_dir=none"
  shape = (f" for {cfg.model_name} ({params / 1e6:,.1f} M parameters) at batch_size={cfg.batch_size} x "
           f"seq_len={cfg.seq_len}" if cfg is not None else f" ({params / 1e6:,.1f} M parameters)")
  _say(f"compiling the train step{shape} on {jax.device_count()} x {device.device_kind} ({estimate}; {where})")
  t0 = time.perf_counter()
  try:
    with compilation_cache.watch() as seen:
      compiled = compile_step(state, batch, reuse=reuse)
  except jax.errors.JaxRuntimeError as e:
    if not memory.is_compile_oom(e):
      raise
    required, available = memory.oom_bytes(e)
    need = "more than it has" if required is None else f"{required / 2**20:,.1f} MiB"
    have = "" if available is None else f" of {available / 2**20:,.1f} MiB usable"
    raise TrainError(f"out of memory (a train step needs {need}{have} on {device.device_kind}: the compiler "
                     f"refused it, {out_of_memory(e)}): {advice}; checked before the first step, "
                     f"nothing was run") from e
  seconds = time.perf_counter() - t0
  # loaded when every compilation in the block came from the cache (the small eager programs of the
  # tracing go through it too, and may hit where the step itself does not)
  hit = seen["requests"] > 0 and seen["hits"] == seen["requests"]
  reused = seen["requests"] == 0   # jax's in-memory caches: compiled before in this process
  if cache_dir and key and not hit and not reused:
    _record_compile_time(cache_dir, key, seconds)
  have, resident = train_lib.available_memory_bytes(device)
  need = train_lib.step_bytes_needed(compiled, arguments_resident=resident)
  fits = have is None or need is None or need <= have
  how = "loaded from the persistent cache" if hit else "compiled earlier in this process" if reused else "compiled"
  need_text = "" if need is None else f"; it needs {need / 2**20:,.1f} MiB by XLA's memory analysis"
  have_text = "" if have is None else f" of {have / 2**20:,.1f} MiB available"
  _say(f"train step ready in {seconds:.1f} s ({how}){need_text}{have_text if need_text else ''}")
  report = {"seconds": round(seconds, 2), "cache_dir": cache_dir, "cache_hits": seen["hits"],
            "cache_requests": seen["requests"], "loaded_from_cache": hit, "need_bytes": need,
            "have_bytes": have, "device_kind": device.device_kind}
  if fits:
    return report
  where = "the host has" if device.platform == "cpu" else f"{device.device_kind} has"
  raise TrainError(f"out of memory (a train step needs {need / 2**20:,.1f} MiB by XLA's compile-time memory "
                   f"analysis; {where} {have / 2**20:,.1f} MiB available): {advice}; checked before "
                   f"the first step, nothing was run")


def _load_step(step_fn, cfg, device) -> dict:
  """`check_step_memory` for a step compiled ahead of time: loads it, says so and how long it took,
  and refuses it as a compiled one when XLA's memory analysis says it cannot fit."""
  path = cfg.compiled_trainstep_file
  _say(f"loading the train step compiled ahead of time from {path} (compiled_trainstep_file)")
  t0 = time.perf_counter()
  exe = compiled_step.deserialize(path, device.device_kind)
  step_fn.install(exe)
  seconds = time.perf_counter() - t0
  have, resident = train_lib.available_memory_bytes(device)
  need = train_lib.step_bytes_needed(exe, arguments_resident=resident)
  need_text = "" if need is None else f"; it needs {need / 2**20:,.1f} MiB by XLA's memory analysis"
  have_text = "" if have is None else f" of {have / 2**20:,.1f} MiB available"
  _say(f"train step ready in {seconds:.1f} s (loaded from {path}){need_text}{have_text if need_text else ''}")
  if have is not None and need is not None and need > have:
    raise TrainError(f"out of memory (the train step in {path} needs {need / 2**20:,.1f} MiB by XLA's memory "
                     f"analysis, {have / 2**20:,.1f} MiB available on {device.device_kind}): "
                     f"{memory_advice(cfg)}, then compile it again; checked before the first step, nothing was run")
  return {"seconds": round(seconds, 2), "cache_dir": None, "cache_hits": 0, "cache_requests": 0,
          "loaded_from_cache": False, "loaded_from_file": str(path), "need_bytes": need, "have_bytes": have,
          "device_kind": device.device_kind}


def train(cfg, *, progress: bool = True) -> dict:
  """Runs (or resumes) training as configured; see the module docstring.

  Args:
    cfg: a config from `model.config.load_config` holding the training keys.
    progress: show a tqdm progress bar.

  Returns:
    dict: "start_step" (0 or the resumed step), "step" (the last step reached), "losses"
    ({step: loss} for the steps this call ran), "evals" ({step: held-out record}), "export"
    (path of the exported parameters, or None when the run stopped early), "state" (the final
    train state), "graphdef", "compile" (`check_step_memory`'s report of the step's compile, or None).

  Raises:
    TrainError: missing/empty data, a tokenizer or resume config that does not match, bad keys;
      XLA's RESOURCE_EXHAUSTED as `out of memory (...): lower ...; <the last checkpoint, intact>`
      (chained to the XLA error; checkpoints already written are not touched).
    model.data.tokenizer.TokenizerError, model.config.ConfigError, model.checkpoint.format.CheckpointError.
  """
  with matmul_precision(cfg.matmul_precision):   # on while the step and eval programs are traced
    return _train(cfg, progress=progress)


def _train(cfg, *, progress: bool) -> dict:
  train_lib.check_train_config(cfg)
  partitioning.mesh_shape(cfg, jax.device_count())  # an impossible mesh fails before anything is read or written
  aot_step = None
  if cfg.compiled_trainstep_file:   # a file for another step fails before anything is read or written too
    aot_step = compiled_step.read(cfg.compiled_trainstep_file)
    compiled_step.check(cfg.compiled_trainstep_file, aot_step, step_header(cfg))
  if not cfg.output_dir:
    raise TrainError("output_dir is required: pass output_dir=DIR (checkpoints, metrics and parameters go there)")
  out = pathlib.Path(cfg.output_dir).absolute()
  if out.exists() and not out.is_dir():
    raise TrainError(f"output_dir={cfg.output_dir!r} exists and is not a directory")
  for above in out.parents:   # the nearest existing directory above it: a file there cannot hold the run
    if above.exists() or above.is_symlink():
      if not above.is_dir():
        raise TrainError(f"output_dir={cfg.output_dir!r}: {str(above)!r} is a file, not a directory, so the run "
                         f"directory cannot be made under it")
      break
  check_output_dir(out, cfg.output_dir, cfg.overwrite)
  tok = _tokenizer(cfg)
  it, windows = build_data(cfg, tok)
  final_step = cfg.stop_at_step if 0 < cfg.stop_at_step < cfg.steps else cfg.steps
  hparams = train_lib.optimizer_hparams(cfg)
  num_slots = cfg.max_num_segments

  created = not out.exists()
  # SIGTERM (a scheduler preempting the job) takes the Ctrl-C path from here on: checkpoint, then exit.
  old_term = None
  interrupts = _Interrupts()
  if threading.current_thread() is threading.main_thread():
    old_term = signal.signal(signal.SIGTERM, interrupts.handler)
  # `step` counts dispatched steps (asynchronous: an out-of-memory surfaces later); `completed` the last
  # step known to have run (its metrics fetched or its checkpoint written).
  start = step = saved = completed = None
  told = False   # the loop said what an interrupt left checkpointed
  try:
    try:
      out.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # e.g. no permission to write in the directory above it
      raise TrainError(f"output_dir={cfg.output_dir!r}: cannot create it ({e.strerror or e})") from None
    ckpt = train_lib.TrainCheckpointer(out / CHECKPOINT_SUBDIR, cfg.checkpoint_keep)
    meta = _meta(cfg, tok)
    latest = ckpt.latest_step()
    saved = latest  # the newest checkpoint on disk (named if the run fails)
    if latest is not None:  # checked before building anything: a refused resume costs nothing
      if not cfg.resume:
        raise TrainError(f"output_dir={cfg.output_dir!r} holds train checkpoints up to step {latest}; pass "
                         f"resume=true to continue that run or choose another output_dir")
      _check_resume(ckpt.read_meta(latest), meta, ckpt.directory)

    # Several devices: the mesh of the ici_*_parallelism keys (model/partitioning.py); None on one device.
    mesh = partitioning.job_mesh(cfg)
    if latest is None and cfg.load_parameters_path:  # fine-tuning: the given parameters, not a random init
      try:
        model = loading.load(cfg.load_parameters_path, config=cfg, mesh=mesh).model
      except checkpointing.CheckpointMismatchError as e:
        raise TrainError(f"{e}; {_differs_from_checkpoint(cfg)}fine-tuning builds the model of the config and "
                         f"overrides given (model_name={cfg.model_name!r}), and the checkpoint's parameters fix "
                         f"its architecture and vocab_size: name the checkpoint's own config or none "
                         f"(kda-train load_parameters_path=DIR then reads DIR/config.json), without overriding "
                         f"those keys") from None
      graphdef, state = train_lib.init_train_state(model, hparams, cfg.train_seed, mesh)
    else:
      graphdef, state = train_lib.create_train_state(cfg, hparams, mesh)
    if mesh is None:
      # Committed to the device, as a restored state is: a fresh run and its resumption then trace one
      # program, so the resume loads the step from the persistent cache instead of compiling it again
      # (jit keys its executables on committed-ness). No copy: the buffers stay where they are.
      state = jax.device_put(state, jax.devices()[0])
    start = completed = 0
    if latest is not None:
      state, data_state = ckpt.restore(latest, state)
      try:
        it.restore(data_state)
      except ValueError as e:
        raise TrainError(f"cannot resume the data iterator from {ckpt.directory / str(latest)}: {e}") from None
      start = completed = int(state["step"])
      if start != it.step:
        raise TrainError(f"checkpoint {ckpt.directory / str(latest)} is inconsistent: train step {start} but "
                         f"data iterator step {it.step}")
      _say(f"resuming from step {start} (checkpoint {ckpt.directory / str(latest)})")

    metrics = MetricsLog(out / METRICS_FILE, start)
    # Donated: the step updates the train state in place (one state live, not two); nothing below
    # reads a state after passing it to step_fn.
    step_fn = train_lib.train_step_fn(graphdef, hparams, num_slots, float(cfg.router_bias_update_rate),
                                      donate=True)
    losses, evals, pending = {}, {}, []
    compile_report = None
    step = start
    t_last = time.perf_counter()
    bar = tqdm(total=final_step, initial=start, disable=not progress, desc="train", unit="step",
               dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)

    def save():
      nonlocal saved, completed
      with interrupts.hold():  # a SIGTERM now is raised once this checkpoint is complete
        ckpt.save(step, state, it.state, meta)
        saved = completed = step

    def log_pending():
      """Writes one metrics record for the steps run since the last one; returns it."""
      nonlocal t_last, completed
      host = [(s, jax.device_get(x)) for s, x in pending]
      for s, x in host:
        losses[s] = float(x["loss"])
      completed = host[-1][0]  # fetched from the device: these steps did run
      now = time.perf_counter()
      last_step, last = host[-1]
      rec = {"step": last_step, "loss": float(np.mean([float(x["loss"]) for _, x in host])),
             "lr": float(last["lr"]), "grad_norm": float(last["grad_norm"]),
             "tokens": int(sum(float(x["tokens"]) for _, x in host)),
             "epoch": round(last_step * cfg.batch_size / it.num_rows, 4),
             "seconds_per_step": round((now - t_last) / len(host), 4)}
      t_last = now
      pending.clear()
      metrics.write(rec)
      return rec

    def run_eval():
      rec = {"step": step, **train_lib.evaluate(graphdef, state, windows, num_slots)}
      evals[step] = rec
      metrics.write(rec)
      bar.write(f"step {step}: heldout_loss {rec['heldout_loss']:.4f}  heldout_ppl {rec['heldout_ppl']:.2f}")

    # On a mesh, steps and evaluations are traced in its context (KDA kernels per head shard).
    mesh_ctx = contextlib.ExitStack()
    to_global = None
    if mesh is not None:
      mesh_ctx.enter_context(partitioning.mesh_context(mesh, cfg))
      # Each process builds only its rows of the global batch (the data axis spans the hosts).
      to_global = train_lib.feed_on_mesh(it, mesh, cfg)
    try:
      while step < final_step:
        batch = next(it)
        if to_global is not None:
          batch = to_global(batch)
        if step == start:  # before the first step: announced, timed, and XLA's own figure of what it needs
          compile_report = check_step_memory(step_fn, state, batch, reuse=mesh is None, cfg=cfg, aot_step=aot_step)
        interrupts.check()
        with interrupts.hold():  # a SIGTERM now is raised once the new state and its metrics are kept
          state, m = step_fn(state, batch)
          step += 1
          pending.append((step, m))
        bar.update(1)
        if step % cfg.log_every == 0 or step == final_step:
          rec = log_pending()
          bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}")
          if not math.isfinite(rec["loss"]):
            raise TrainError(f"the loss became {rec['loss']} at step {step}; lower learning_rate or "
                             f"grad_clip_norm (the last finite checkpoint is kept in {ckpt.directory})")
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == final_step:
          save()
        if windows and (step % cfg.eval_every == 0 or step == cfg.steps):
          run_eval()
        if cfg.export_every and step % cfg.export_every == 0 and step < cfg.steps:
          export_parameters(out / f"{PARAMS_SUBDIR}-{step}", graphdef, state, cfg)
    except KeyboardInterrupt:
      told = True
      # The interrupt may land between next(it) and the state update: re-derive the position from
      # the state (batches are a pure function of the step) so the checkpoint is consistent.
      if any(x.is_deleted() for x in jax.tree.leaves(state)):
        # landed inside step_fn after it took the donated state and before it returned the new one:
        # no state to save; the last checkpoint stands
        bar.write(f"interrupted inside a step: nothing newer than the last checkpoint in {ckpt.directory}")
        raise
      step = int(jax.device_get(state["step"]))
      it.step = step
      if pending:
        log_pending()
      if step > start and step not in ckpt.all_steps():
        save()
        bar.write(f"interrupted: checkpointed step {step} in {ckpt.directory}; run the same command to resume")
      elif step > start:   # landed while this step's checkpoint was written: it is complete
        bar.write(f"interrupted: step {step} is checkpointed in {ckpt.directory}; run the same command to resume")
      raise
    finally:
      mesh_ctx.close()
      bar.close()
      metrics.close()
      ckpt.close()

    exported = None
    if step >= cfg.steps:
      exported = export_parameters(out / PARAMS_SUBDIR, graphdef, state, cfg)
    return {"start_step": start, "step": step, "losses": losses, "evals": evals, "export": exported,
            "state": state, "graphdef": graphdef, "compile": compile_report}
  except KeyboardInterrupt:
    if completed is None or completed == start:  # interrupted before this run's first step finished
      _nothing_saved(out, created, start)
    elif not told:   # after the loop: while the parameters were exported
      _say(f"interrupted: the last checkpoint, step {saved}, is in {out / CHECKPOINT_SUBDIR}; run the same "
           f"command to resume (and export)")
    raise
  except Exception as e:
    if completed is None or completed == start:  # no step completed: leave no empty run directory behind
      _remove_unused_run(out, created)
    msg = out_of_memory_message(e, memory_advice(cfg))
    if msg is None:
      raise
    if saved is None:
      kept = "no checkpoint had been written yet, so there is nothing to resume"
    else:
      kept = (f"nothing was lost beyond the last checkpoint, step {saved} in {out / CHECKPOINT_SUBDIR}, which is "
              f"intact (resuming needs the same batch_size and seq_len; eval_batch_size may change)")
    raise TrainError(f"{msg}; {kept}") from e
  finally:
    if old_term is not None:
      signal.signal(signal.SIGTERM, old_term)
