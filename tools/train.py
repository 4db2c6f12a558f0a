"""Trains a Kimi-Linear model on a text corpus, MaxText style.

Usage:
  python -m tools.train [MODEL_CONFIG] train_data=FILE tokenizer_path=TOK.model output_dir=DIR \\
      [key=value ...]

MODEL_CONFIG is a module of configs/ (tiny, demo, ...) or a .py/.json config path; every key of
configs/base.py can be overridden with key=value (the training keys are listed below).
`load_parameters_path=DIR` starts from a parameter checkpoint (fine-tuning) instead of random init;
without MODEL_CONFIG the model and tokenizer are DIR's (its config.json and tokenizer copy), and a
MODEL_CONFIG named must describe the same model;
`tokenizer_path` may be left empty with train_data_format=ids (token ids, one document per line).

What a run does:
  * data: the train side of the held-out split of `train_data` (the last `heldout_fraction` of the
    bytes is never trained on), tokenised, documents framed with bos/eos, shuffled with `data_seed`,
    packed with segment ids into [batch_size, seq_len] rows (model.data.pipeline);
  * loss: next-token cross entropy, masked on padding and across document boundaries;
  * optimizer: AdamW with linear warmup and cosine decay, global-norm gradient clipping
    (model.training.steps); the forward runs in mode "train" (kda_native routes it to kda_chunked);
  * checkpoints: the whole train state (params, optimizer state, step, PRNG key) and the data
    iterator's position every `checkpoint_every` steps into DIR/checkpoints (Orbax, last
    `checkpoint_keep` kept). Running the same command again resumes from the latest checkpoint (it
    prints "resuming from step N (checkpoint DIR/checkpoints/N)") and continues exactly as an
    uninterrupted run; `stop_at_step=N` ends a run early on purpose, Ctrl-C
    (or SIGTERM) checkpoints the current step before exiting;
  * evaluation: held-out loss and perplexity every `eval_every` steps and at the end, over the
    first `eval_max_windows` held-out windows, each window scored on its own (a quick, slightly
    pessimistic estimate; tools.perplexity carries state across windows for the exact figure);
  * logs: a progress bar, and one JSON object per line in DIR/metrics.jsonl
    ({"step", "loss", "lr", "grad_norm", "tokens", "epoch", "seconds_per_step"} and
    {"step", "heldout_loss", "heldout_ppl", "heldout_tokens"}); a record covers the steps since the one
    before it (every `log_every` steps; after a resume the first covers those since the checkpoint):
    loss and seconds_per_step are their means, tokens their sum, lr and grad_norm the last step's;
  * compile: announced before it starts ("compiling the train step for ... (this takes ...; persistent
    cache at DIR)") and timed when done ("train step ready in N s (compiled | loaded from the persistent
    cache); it needs X MiB ... of Y MiB available"). jax's persistent compilation cache
    (`compilation_cache_dir`: "" = $KDA_COMPILATION_CACHE_DIR or ~/.cache/kda_plugin/jax, none = off)
    makes a restart or a resume load the step instead of compiling it again;
    `compiled_trainstep_file=PATH` (MaxText's key) loads the step that `kda-aot-compile ... mode=train
    compiled_trainstep_file=PATH` compiled ahead of time on another host for this target ("train step
    ready in N s (loaded from PATH)"): a large model's step then costs seconds here instead of
    minutes. The file must match the run: same jax and jaxlib, device kind, device count, mesh and
    every key that shapes the step (model/training/compiled_step.py); otherwise one line names the
    differences, before anything is read or written;
  * export: the parameters in the project's checkpoint format (model.checkpoint.format: Orbax params +
    config.json + tokenizer copy) to DIR/params at the end, so `load_parameters_path=DIR/params` alone
    serves tools.generate and tools.perplexity.

output_dir must be new, empty, or a run directory of this tool (it holds checkpoints/ or
metrics.jsonl: a run to resume, see resume=, or a finished one). Any other non-empty directory is
refused before anything is read or written, so a typo cannot scatter a run among unrelated files;
`overwrite=true` writes the run into it anyway (nothing there is deleted; the run's own
checkpoints/, metrics.jsonl and params/ are created or replaced).

Errors (missing or empty data, a tokenizer that does not fit the config, a resume whose config
does not match the checkpoint) are printed as one line naming the key; the exit status is 2. So is
a step that cannot fit, refused after its compile and before it runs: `error: out of memory (a train
step needs N MiB by XLA's compile-time memory analysis; <device> has M MiB available): lower batch_size
or seq_len ...; or set remat_policy=... -> full ...; moe_impl=... -> megablox ...; checked before the
first step, nothing was run` (on a TPU the figure is the compiled step's memory_analysis against the
chip's memory, or libtpu's own figure when it refuses to compile the step). So is running out of
memory later (XLA's RESOURCE_EXHAUSTED): `error: out of memory (<XLA's first line>): lower batch_size
or seq_len ...; nothing was lost beyond the last checkpoint ...` (the checkpoints already written are
left as they are; a resume needs the same batch_size and seq_len, eval_batch_size may change).
"""

from __future__ import annotations

import inspect

from configs import base as base_config
from model import partitioning, registry
from model.config import load_config
from model.engine import compilation_cache
from model.training.trainer import MEMORY_KEYS, train
from tools import cli

__all__ = ["MEMORY_KEYS", "main", "train"]


def training_keys_help() -> str:
  """The training section of configs/base.py (keys, defaults, comments), for --help."""
  lines = inspect.getsource(base_config).splitlines()
  start = next(i for i, line in enumerate(lines) if "# ---- Training" in line)
  end = next((i for i in range(start + 1, len(lines)) if "# ----" in lines[i] or "c.lock()" in lines[i]),
             len(lines))
  return "\n".join(line.strip().removeprefix("c.") for line in lines[start + 1:end] if line.strip())


def training_config(argv: list[str]):
  """The run's config from `[MODEL_CONFIG] key=value ...`. With `load_parameters_path=DIR` and no
  MODEL_CONFIG the model is DIR's own: its config.json, its tokenizer copy unless tokenizer_path is given,
  the base defaults for the training keys, then the overrides (as the serving tools read a checkpoint).

  Raises:
    ConfigError: an unknown config or key, a bad value. CheckpointError: DIR is no checkpoint.
  """
  cfg = load_config(argv)
  if cfg.load_parameters_path and not (argv and "=" not in argv[0]):
    cfg = cli.checkpoint_config(cfg, argv)
  return cfg


def run(argv: list[str]) -> int:
  """Parses `[MODEL_CONFIG] key=value ...` and trains; raises on bad input (see the module docstring)."""
  cfg = training_config(argv)
  registry.get_backend(cfg.attention)  # an unknown attention= fails before anything is read or written
  partitioning.initialize_distributed(cfg)  # multi-host jobs (distributed_init=true): before any device use
  compilation_cache.enable(cfg.compilation_cache_dir)  # before the first compilation; the trainer names it
  try:
    result = train(cfg)
  except KeyboardInterrupt:
    return 130  # the loop has said what it checkpointed
  if result["export"] is not None:
    print(f"trained to step {result['step']}; parameters: {result['export']}")
  else:
    print(f"stopped at step {result['step']} (stop_at_step); run the same command with stop_at_step=0 "
          f"to continue")
  return 0


main = cli.tool_main(run, __doc__,
                     help_text=lambda: "Training keys (configs/base.py; defaults shown):\n\n" + training_keys_help())
command = cli.command(main)

if __name__ == "__main__":
  command()
