r"""Serve a checkpoint over HTTP with an OpenAI-compatible API (FastAPI + uvicorn, one engine loop).

Usage:
  python -m tools.serve load_parameters_path=DIR [engine=continuous|static] [max_num_seqs=8]
      [max_model_len=2048] [max_num_batched_tokens=2048] [max_num_partial_prefills=0] [max_waiting=128]
      [prefix_cache_bytes=N] [min_bucket_tokens=0]
      [host=127.0.0.1] [port=8000 | uds=PATH] [compilation_cache_dir=DIR|none] [attention=kda_native]
      [ici_*_parallelism=...]

Routes: POST /v1/completions (prompt as text or token ids; max_tokens, temperature, top_p, top_k, stop,
seed, stream (server-sent events ending with `data: [DONE]`), logprobs, ignore_eos, return_token_ids),
POST /v1/chat/completions (messages rendered with the tokenizer's chat template, e.g. a Kimi tokenizer
directory; 400 chat_template_missing for a tokenizer without one), GET /v1/models, GET /health, GET /metrics (Prometheus). Details: model/server/app.py,
sampling rules: model/server/protocol.py.

Keys (vLLM's names; none is written into a checkpoint):
  load_parameters_path    checkpoint directory (config.json + params/, tokenizer.model when it has one). Required.
  engine                  continuous (slot pool, mixed prefill + decode steps, chunked prefill, prefix cache)
                          or static (today's Generator: groups of up to max_num_seqs requests; the next group
                          starts when the whole group has ended; the benchmark's baseline).
  max_num_seqs            requests decoding at once (slots).
  max_model_len           prompt + output tokens of one request; also the model's MLA cache length
                          (max_cache_length is set to it). Longer requests get HTTP 400.
  max_num_batched_tokens  tokens one engine step may process (continuous: the prefill chunk budget; static:
                          the prompt tokens of one group's prefill row).
  max_num_partial_prefills  continuous: prompts (whole or a chunk) prefilled in one step, in [1, max_num_seqs];
                          0 (the default) = min(4, max_num_seqs). The step prefills on a sub-pool of that many
                          slots, so its cost grows with it (docs/serving.md section 'Keys').
  min_bucket_tokens       continuous: the smallest row bucket a step is compiled for; 0 (the default) = 128
                          on a TPU (a smaller row costs as much there), 16 elsewhere. Fewer buckets: fewer
                          executables to compile at start-up (docs/serving.md 'Shape buckets').
  max_waiting             waiting requests at which new ones get HTTP 503.
  prefix_cache_bytes      byte budget of the continuous engine's prefix cache (0 = off), in device memory
                          (HBM on an accelerator; more than is free after the weights and the slot pool
                          is refused); engine=static has none (giving it there is an error).
  host, port              where to listen (port=0: any free port). The line "listening on http://HOST:PORT"
                          goes to stdout once the server accepts requests.
  uds                     listen on this unix-domain socket path instead of TCP (`--uds PATH` works too;
                          for machines where TCP cannot be opened, e.g. the lent TPU). The line is then
                          "listening on unix:PATH"; clients use a unix-socket transport (httpx
                          HTTPTransport(uds=PATH), the openai client over such an httpx client, curl
                          --unix-socket PATH http://localhost/v1/models). The socket file is removed at exit.
  compilation_cache_dir   jax's persistent compilation cache, so a restart loads the step executables
                          instead of compiling them: "" (default) = $KDA_COMPILATION_CACHE_DIR, else
                          ~/.cache/kda_plugin/jax; none = off (model/engine/compilation_cache.py).
  matmul_precision        default | high | highest: jax's precision of the float32 matmuls of the engine's steps
                          (on a TPU, default is one bfloat16 pass; highest is float32).
  generate_add_bos        prepend BOS to text prompts (default true, as tools.generate).
  tokenizer_path          (a model key) sentencepiece .model for text prompts; default: the checkpoint's copy,
                          if any; tokenizer_path=none (or empty): no tokenizer, prompts as token ids only.
  ici_*_parallelism       with several devices: the mesh to serve on (model/partitioning.py).

Start-up compiles every step executable of the engine before it listens (several at once, on
$KDA_COMPILE_THREADS threads, default half the cores): a progress bar and one line per executable
(name, seconds, compiled or loaded from the persistent cache) on stderr, then "compiled N step
executables in S s" and the start-up time.

SIGTERM or Ctrl-C drains: new requests get 503, running ones finish (those still running after 30 s
are cancelled), then the server exits with status 0 (a SIGTERM before it listens: status 0 as well). A bad key or value, a missing checkpoint or an
address in use prints one `error:` line and exits with status 2 before serving.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from model import partitioning
from model.config import matmul_precision
from model.engine.api import Request
from model.engine import compilation_cache
from model.engine.config import EngineConfig
from model.engine.factory import build_engine
from model.errors import UsageError
from model.server.app import ServerState, build_app
from model.server.loop import EngineLoop
from model.engine.warmup import compile_engine
from model.server.runner import bind, bind_unix, serve
from tools import cli as common

# What sizes the engine's memory: named in the one-line error when XLA runs out of memory.
MEMORY_KEYS = "max_num_seqs, max_model_len or max_num_batched_tokens"
DRAIN_TIMEOUT_S = 30.0


def check_server_keys(cfg) -> None:
  """UsageError naming the first server key out of range (the engine's are `EngineConfig`'s)."""
  if cfg.max_waiting < 1:
    raise UsageError(f"max_waiting must be an integer >= 1, got {cfg.max_waiting}")
  if not 0 <= cfg.port <= 65535:
    raise UsageError(f"port must be in [0, 65535], got {cfg.port}")
  if not cfg.host:
    raise UsageError("host is empty: give an address to listen on, e.g. host=127.0.0.1")


def warm_up(engine, progress: bool = True) -> float:
  """Compiles what the engine will run (`model.engine.warmup.compile_engine`: every step executable
  of the continuous engine, so no request waits behind a compilation; a tqdm bar and a line per
  executable on stderr when `progress`), then runs one 1-token request to its end; returns the
  seconds it took. `engine.compile_report` holds the compilation's `CompileReport`."""
  t0 = time.perf_counter()
  engine.compile_report = compile_engine(engine, progress=progress)
  engine.add_request(Request("warm-up", (0,), 1))
  while engine.has_unfinished():
    engine.step(lambda event: None)
  return time.perf_counter() - t0


def uds_argv(argv: list[str]) -> list[str]:
  """`--uds PATH` (two arguments, as uvicorn spells it) as the key=value `uds=PATH`."""
  out, i = [], 0
  while i < len(argv):
    if argv[i] == "--uds":
      if i + 1 >= len(argv):
        raise UsageError("--uds needs a path: --uds PATH (or uds=PATH)")
      out.append(f"uds={argv[i + 1]}")
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


class _StopBeforeListening(Exception):
  """SIGTERM arrived while the server was still loading or compiling (nothing to drain)."""


def _stop_before_listening(signum, frame):
  raise _StopBeforeListening(signal.Signals(signum).name)


def run(argv: list[str]) -> int:
  """Serves as the `key=value` arguments say (see the module docstring); raises on bad input."""
  # Until uvicorn installs its draining handlers, SIGTERM (e.g. a supervisor stopping a server that is
  # still compiling) ends start-up with a line and status 0, as a drain would, not by the signal.
  previous = signal.signal(signal.SIGTERM, _stop_before_listening)
  try:
    return _run(argv)
  except _StopBeforeListening as e:
    print(f"{e}: stopped before listening (nothing was served); exiting", file=sys.stderr, flush=True)
    return 0
  finally:
    signal.signal(signal.SIGTERM, previous)


def _run(argv: list[str]) -> int:
  started_at = time.perf_counter()
  argv = uds_argv(argv)
  overrides, cfg = common.parse_args(argv)
  # Process-wide while the server lives: the engine traces its steps on the engine-loop thread too.
  with matmul_precision(cfg.matmul_precision):
    return _serve(argv, overrides, cfg, started_at)


def _serve(argv: list[str], overrides: list[str], cfg, started_at: float) -> int:
  engine_config = EngineConfig.from_config(cfg, common.given_keys(argv))   # checked before anything loads
  check_server_keys(cfg)
  stored = common.checkpoint_config(cfg, overrides, extra=[f"max_cache_length={cfg.max_model_len}"])
  tokenizer = common.tokenizer_for(stored)
  vocab = int(stored.vocab_size)
  # an address in use fails now, before the model loads
  sock = bind_unix(cfg.uds) if cfg.uds else bind(cfg.host, cfg.port)
  print(compilation_cache.enable(cfg.compilation_cache_dir), file=sys.stderr, flush=True)
  print(f"loading {stored.load_parameters_path} ...", file=sys.stderr, flush=True)
  model, mcfg, mesh = common.load(stored)
  if mesh is not None:
    print(f"serving on {partitioning.describe_mesh(mesh)}", file=sys.stderr)
  engine = build_engine(engine_config, model, vocab_limit=min(vocab, tokenizer.vocab_size), mesh=mesh, rules=mcfg)
  seconds = warm_up(engine)
  cache = (f"prefix cache {engine_config.prefix_cache_bytes} bytes, max_num_partial_prefills="
           f"{engine_config.num_partial_prefills}" if cfg.engine == "continuous" else "no prefix cache")
  print(f"model {mcfg.model_name} from {mcfg.load_parameters_path}: attention={mcfg.attention}, dtype={mcfg.dtype}; "
        f"engine={cfg.engine}, max_num_seqs={cfg.max_num_seqs}, max_model_len={cfg.max_model_len}, "
        f"max_num_batched_tokens={cfg.max_num_batched_tokens}, {cache}", file=sys.stderr)
  compile_s = engine.compile_report.seconds
  first = "a first 1-token request" + (", compiling on first use" if cfg.engine == "static" else "")
  print(f"start-up {time.perf_counter() - started_at:.1f} s (compile {compile_s:.1f} s, {first} "
        f"{seconds - compile_s:.1f} s)", file=sys.stderr, flush=True)
  loop = EngineLoop(engine)
  loop.start()
  state = ServerState(loop, tokenizer, model_name=str(mcfg.model_name), max_waiting=cfg.max_waiting,
                      add_bos=cfg.generate_add_bos)
  where = f"unix:{os.path.abspath(cfg.uds)}" if cfg.uds else f"http://{cfg.host}:{sock.getsockname()[1]}"
  started = lambda: print(f"listening on {where}", flush=True)
  try:
    serve(build_app(state), state, sock, drain_timeout_s=DRAIN_TIMEOUT_S, on_started=started)
  finally:
    loop.stop()
    if cfg.uds:
      with contextlib.suppress(OSError):
        os.unlink(cfg.uds)
  print("drained; exiting", file=sys.stderr)
  return 0


main = common.tool_main(run, __doc__)
command = common.command(main)

if __name__ == "__main__":
  command()
