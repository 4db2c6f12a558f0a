"""A tiny Hugging Face Kimi-Linear checkpoint directory that carries the fixture Kimi tokenizer
(tests/fixtures/kimi_tokenizer: tiktoken.model, tokenizer_config.json with the chat template,
generation_config.json), as a released Kimi-Linear checkpoint carries its own.

The weights are configs/tiny's architecture with the tokenizer's vocabulary and special ids, randomly
initialised (`model.loading.create`, seed 0), written in transformers' spelling by the project's to_hf
conversion; the tokenizer files are copied in beside them. Converting the directory back with
`kda-convert hf_model_path=...` is what the tests under test exercise.
"""

from __future__ import annotations

import pathlib
import shutil

REPO = pathlib.Path(__file__).resolve().parents[2]
KIMI_TOKENIZER = REPO / "tests" / "fixtures" / "kimi_tokenizer"
MODEL_NAME = "tiny-kimi"


def tiny_kimi_config(max_cache_length: int = 128):
  """configs/tiny with the Kimi fixture tokenizer's vocabulary (2304) and special ids (bos [BOS] 2048,
  eos <|im_end|> 2050 as the real config.json has it, pad [PAD] 2303)."""
  from configs import tiny
  from model.data.tokenizer_kimi import KimiTokenizer
  tok = KimiTokenizer(KIMI_TOKENIZER)
  cfg = tiny.get_config()
  cfg.model_name = MODEL_NAME
  cfg.vocab_size = tok.vocab_size
  cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_id, tok.special_tokens["<|im_end|>"], tok.pad_id
  cfg.max_cache_length = max_cache_length
  return cfg


def write_tiny_kimi_hf(dst: pathlib.Path, *, tokenizer_files=None) -> pathlib.Path:
  """Writes the HF directory at `dst` (config.json, model.safetensors and the tokenizer files named by
  `tokenizer_files`, default every file of the fixture) and returns it."""
  from model import loading
  from model.checkpoint.format import save_parameters
  from model.hf.convert import ConvertArgs, orbax_to_hf
  dst = pathlib.Path(dst)
  staging = dst.parent / f".{dst.name}-orbax"
  cfg = tiny_kimi_config()
  save_parameters(staging, loading.create(cfg, seed=0), cfg)
  orbax_to_hf(ConvertArgs(direction="to_hf", load_parameters_path=str(staging), output_path=str(dst)))
  shutil.rmtree(staging)
  names = tokenizer_files if tokenizer_files is not None else sorted(p.name for p in KIMI_TOKENIZER.iterdir())
  for name in names:
    shutil.copyfile(KIMI_TOKENIZER / name, dst / name)
  return dst
