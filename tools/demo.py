"""`make demo`: generate a continuation with the small Kimi-Linear model shipped in the package.

Usage:
  python -m tools.demo [prompt="text"] [max_new_tokens=N] [key=value ...]

Runs `tools.generate` on the embedded demo checkpoint, `kda_plugin/assets/demo/` (a 6-layer hybrid:
4 KDA layers, 2 MLA layers, MoE; trained on tiny shakespeare, see TRAINING.md there), with a
default prompt, and prints the continuation. Any other key=value is passed on to tools.generate
(e.g. decode_sampling_strategy=greedy, seed=3, attention=kda_reference).

When the demo checkpoint is missing (a broken install), it says so loudly and runs a randomly
initialised model of the same shape instead, so the pipeline is still shown end to end; its
output is noise.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import kda_plugin
from model import loading
from model.checkpoint import format as checkpointing
from model.config import load_config
from tools import cli, generate

ASSETS = pathlib.Path(kda_plugin.__file__).resolve().parent / "assets" / "demo"
DEFAULTS = {
    "prompt": "ROMEO:\nWhat light through yonder window",
    "max_new_tokens": "120",
    "decode_sampling_strategy": "topk",
    "decode_sampling_top_k": "20",
    "decode_sampling_temperature": "0.8",
    "seed": "0",
}
BANNER = "!" * 78


def _random_checkpoint(directory: pathlib.Path) -> pathlib.Path:
  """Saves a randomly initialised demo-config model (with the shipped tokenizer, if present)."""
  tok = ASSETS / "tokenizer.model"
  cfg = load_config(["demo", f"tokenizer_path={tok if tok.is_file() else ''}"])
  path = directory / "random-demo"
  checkpointing.save_parameters(path, loading.create(cfg), cfg)
  return path


def run(argv: list[str]) -> int:
  """Runs the demo; returns the exit status of tools.generate."""
  given = {a.split("=", 1)[0] for a in argv if "=" in a}
  args = [f"{k}={v}" for k, v in DEFAULTS.items() if k not in given] + argv
  with tempfile.TemporaryDirectory(prefix="kda-demo-") as tmp:
    if checkpointing.is_checkpoint(ASSETS):
      ckpt = ASSETS
    else:
      print(f"{BANNER}\n!! NO DEMO CHECKPOINT at {ASSETS}\n!! Running a RANDOMLY INITIALISED model of "
            f"the demo shape instead:\n!! the text below is noise, not a trained model's output.\n{BANNER}",
            file=sys.stderr)
      ckpt = _random_checkpoint(pathlib.Path(tmp))
      if not (ASSETS / "tokenizer.model").is_file():  # no tokenizer either: prompt with token ids
        args = [a for a in args if not a.startswith("prompt=")] + (
            [] if "prompt_ids" in given else ["prompt_ids=2,100,200,300"])
    print(f"demo checkpoint: {ckpt}", file=sys.stderr)
    # tools.generate prints the prompt and streams the continuation after it.
    return generate.run([f"load_parameters_path={ckpt}", *args])


main = cli.tool_main(run, __doc__, memory_keys=generate.MEMORY_KEYS)
command = cli.command(main)

if __name__ == "__main__":
  command()
