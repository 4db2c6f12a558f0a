"""Build a Kimi-Linear model from a config, run packed forwards and report who served them.

    python -m tools.forward_check [model config] [key=value ...] [--batch B] [--seq T] [--docs N]
                                  [--decode-steps n] [--repeats r]

Builds the model with random weights (seed `init_seed`), runs a packed forward in each mode
(train, eval, prefill, then decode steps) and prints, per mode, the attention backend and the op it
called (e.g. "kda_native -> kda_inference[xla]"), a logits checksum and timings (first call with
compilation, then the median of the repeats). Config keys: see configs/base.py. Without a model
config name it uses `tiny` and says so in one line (the base config is the 48B model).

Exit status: 0; 1 when a mode failed (each is reported); 2 for a bad argument or when XLA runs out of
memory (one `error:` line naming --seq and --batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import loading, partitioning
from model.config import load_config, matmul_precision
from model.errors import UsageError, out_of_memory
from model.nn.kimi_linear import last_token_logits
from tools import cli


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are `UsageError`s (one `error:` line through tools.cli, not usage + exit)."""

  def error(self, message):
    raise UsageError(message)


def _parser():
  p = _Parser(add_help=False,
      prog="python -m tools.forward_check",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Example: python -m tools.forward_check tiny attention=kda_reference dtype=bfloat16")
  p.add_argument("config", nargs="*", help="[model config name or .py/.json path; default tiny] then key=value overrides")
  p.add_argument("--batch", type=int, default=2, help="packed rows B (default 2)")
  p.add_argument("--seq", type=int, default=64, help="tokens per row T (default 64)")
  p.add_argument("--docs", type=int, default=3, help="documents packed per row (default 3, <= max_num_segments)")
  p.add_argument("--decode-steps", type=int, default=2, help="decode steps after prefill (default 2)")
  p.add_argument("--modes", default="train,eval,prefill",
                 help="comma-separated modes to run: train, eval, prefill (prefill includes the decode steps)")
  p.add_argument("--repeats", type=int, default=3, help="timed repeats per mode after the first call (default 3, >= 1)")
  return p


def packed_batch(rng: np.random.Generator, vocab: int, batch: int, seq: int, docs: int):
  """Random tokens and segment ids: `docs` documents of random lengths per row, then padding."""
  ids = rng.integers(3, vocab, size=(batch, seq), dtype=np.int32)
  seg = np.zeros((batch, seq), np.int32)
  for b in range(batch):
    used = seq - rng.integers(0, max(1, seq // 8))             # a little trailing padding
    cuts = np.sort(rng.choice(np.arange(1, used), size=min(docs, used) - 1, replace=False))
    for label, (lo, hi) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, used]), start=1):
      seg[b, lo:hi] = label
  positions = np.zeros_like(seg)
  for b in range(batch):
    for label in range(1, docs + 1):
      idx = np.nonzero(seg[b] == label)[0]
      positions[b, idx] = np.arange(idx.size)
  return jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(positions)


class _OutOfMemory(Exception):
  """XLA's RESOURCE_EXHAUSTED in a mode: the message is the tool's one `error:` line."""


def _timed(fn, *args, repeats):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    runs.append(time.perf_counter() - t0)
  return out, first, statistics.median(runs) if runs else float("nan")  # repeats=0 only for decode steps > 0


def _checksum(x):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return f"sum={x.sum():+.6e} mean|x|={np.abs(x).mean():.6e}"


DEFAULT_CONFIG = "tiny"


def config_argv(config: list[str]) -> list[str]:
  """`config` with the model-config name `tiny` put first when none is given (announced in one line).

  The base config is the 48B model: built at random it needs ~100 GB and would be killed by the kernel
  without a word, which is no default for a smoke tool; an explicit name (`demo`, `kimi-linear-48b-a3b`,
  a .py/.json path) is used as given.
  """
  if config and "=" not in config[0]:
    return list(config)
  print(f"no model config given: using {DEFAULT_CONFIG!r} (name one first, e.g. demo or kimi-linear-48b-a3b, "
        f"for another)", flush=True)
  return [DEFAULT_CONFIG, *config]


def run(argv: list[str]) -> int:
  """Builds the model, runs each mode and prints who served it; raises on bad input."""
  args = _parser().parse_args(argv)
  # Every bad argument is one `error:` line and exit status 2, before the model is built.
  for flag, value, low in (("--batch", args.batch, 1), ("--seq", args.seq, 1), ("--docs", args.docs, 1),
                           ("--decode-steps", args.decode_steps, 0), ("--repeats", args.repeats, 1)):
    if value < low:
      raise UsageError(f"{flag} must be >= {low}, got {value}")
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  unknown = sorted(set(modes) - {"train", "eval", "prefill"})
  if unknown or not modes:
    raise UsageError(f"--modes: unknown {unknown}; choose from train, eval, prefill")
  cfg = load_config(config_argv(args.config))
  partitioning.mesh_shape(cfg, jax.device_count())  # the ici_* keys must fit the devices, even one
  if args.docs > cfg.max_num_segments:
    raise UsageError(f"--docs={args.docs} exceeds max_num_segments={cfg.max_num_segments}")
  with matmul_precision(cfg.matmul_precision):   # on while each mode's program is traced
    return _check(cfg, args, modes)


def _check(cfg, args, modes: list[str]) -> int:
  model = loading.create(cfg)  # random weights of seed init_seed
  backend = model.backend
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model)))
  print(f"model {cfg.model_name}: {cfg.num_hidden_layers} layers {''.join(t[0] for t in model.args.layer_types)}"
        f" (k=KDA, m=MLA), d={cfg.hidden_size}, {n_params:,} parameters, dtype={cfg.dtype}, "
        f"weights={cfg.weight_dtype}, attention={cfg.attention}, devices={jax.devices()}")
  ids, seg, pos = packed_batch(np.random.default_rng(cfg.init_seed), cfg.vocab_size, args.batch, args.seq, args.docs)
  n = cfg.max_num_segments
  graphdef, state = nnx.split(model)

  def run(mode):
    def f(state, ids, seg, pos):
      return nnx.merge(graphdef, state)(ids, seg, pos, mode=mode, max_num_segments=n)
    return jax.jit(f)

  @jax.jit
  def prefill(state, ids, seg, pos):
    m = nnx.merge(graphdef, state)
    logits, cache = m.prefill(ids, seg, pos, num_slots=n, cache_length=args.seq + args.decode_steps)
    return logits, cache, last_token_logits(logits, seg, n)

  @jax.jit
  def decode(state, tok, cache):
    return nnx.merge(graphdef, state).decode(tok, cache)

  kda = "kda" in model.args.layer_types
  route = lambda mode: backend.describe(mode, cfg.kda_implementation) if kda else "(no KDA layers)"
  print(f"batch: B={args.batch} T={args.seq}, {args.docs} packed documents per row, "
        f"{int(jnp.sum(seg == 0))} padding tokens")
  failed = []

  def attempt(mode, fn):
    try:
      fn()
    except Exception as e:  # report every mode, then fail
      if out_of_memory(e) is not None:  # every mode would fail the same way: stop with one line
        raise _OutOfMemory(f"error: out of memory in the {mode} pass ({out_of_memory(e)}): lower --seq "
                           f"(T={args.seq}) or --batch (B={args.batch})") from None
      failed.append(mode)
      print(f"[{mode:7s}] FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

  def fwd(mode):
    logits, first, med = _timed(run(mode), state, ids, seg, pos, repeats=args.repeats)
    print(f"[{mode:7s}] {route(mode)} | logits {tuple(logits.shape)} {_checksum(logits)} | "
          f"first {first * 1e3:.1f} ms, median {med * 1e3:.2f} ms")

  def generate():
    (logits, cache, last), first, med = _timed(prefill, state, ids, seg, pos, repeats=args.repeats)
    print(f"[prefill] {route('prefill')} | logits {tuple(logits.shape)} {_checksum(logits)} | "
          f"first {first * 1e3:.1f} ms, median {med * 1e3:.2f} ms")
    tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
    for step in range(args.decode_steps):
      (dl, cache), first, med = _timed(decode, state, tok, cache, repeats=args.repeats if step == 0 else 0)
      print(f"[decode ] {route('decode')} | step {step}: logits {tuple(dl.shape)} {_checksum(dl)} | "
            f"first {first * 1e3:.1f} ms" + (f", median {med * 1e3:.2f} ms" if step == 0 else ""))
      tok = jnp.argmax(dl, axis=-1).astype(jnp.int32)
  try:
    for mode in [m for m in ("train", "eval") if m in modes]:
      attempt(mode, lambda mode=mode: fwd(mode))
    if "prefill" in modes:
      attempt("prefill", generate)
  except _OutOfMemory as e:
    print(str(e), file=sys.stderr)
    return 2
  if failed:
    print(f"FAILED modes: {failed}")
    return 1
  return 0


main = cli.tool_main(run, __doc__ + "\n" + _parser().format_help())
command = cli.command(main)

if __name__ == "__main__":
  command()
