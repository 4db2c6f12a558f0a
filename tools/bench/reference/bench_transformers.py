"""CPU throughput of HF transformers' Kimi-Linear on a demo-sized model: the reference side of our benchmark.

Runs under the Python 3.11 reference venv (see tests/fixtures/README.md; torch 2.13 CPU, transformers
>= 5.17, no triton, so transformers uses its torch fallbacks for KDA and the short convolutions):

  .venv-ref/bin/python tools/bench/reference/bench_transformers.py --save-dir runs/reference/demo_hf \
      --json runs/reference/bench_transformers.json

Builds a random float32 `KimiLinearForCausalLM` with the layout of configs/demo.py (6 layers, hidden
256, KDA at 1, 2, 4, 5 and MLA at 3, 6 (1-indexed), 4 KDA heads x 64, MoE with 8 experts top-2 plus
one shared expert from layer 1 on, vocab 4096) or loads one (`--model-dir`), saves it with
`save_pretrained` (`--save-dir`, for our conversion tool), then measures on `--threads` torch threads:

- prefill: one forward of `--prefill-tokens` tokens, batch 1, filling the cache, last-token logits
  only (what `generate` does); tokens/s = tokens / median seconds.
- decode: after that prefill, `--decode-tokens` greedy steps of one token each through the cache
  (KDA recurrent step + conv state, MLA latent cache); tokens/s = tokens / median seconds of the loop.

Medians over `--runs` timed repetitions after one warm-up (the best run is reported too: on a shared
machine it is the figure least inflated by other processes). Prints the figures and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

DEMO_CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
    q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.446, first_k_dense_replace=1, rms_norm_eps=1e-5, hidden_act="silu",
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4,
                        "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6]},
)


def check_environment() -> None:
  """Exits when triton is importable (transformers would bind GPU kernels that fail on CPU)."""
  try:
    import triton  # noqa: F401
  except ImportError:
    return
  sys.exit("triton is importable in this venv: transformers would bind its GPU kernels. "
           "Use the reference venv without triton (tests/fixtures/README.md).")


def build_model(args) -> KimiLinearForCausalLM:
  if args.model_dir is not None:
    return KimiLinearForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
  torch.manual_seed(args.seed)
  cfg = dict(DEMO_CONFIG, vocab_size=args.vocab_size)
  model = KimiLinearForCausalLM(KimiLinearConfig(**cfg)).eval()
  # HF init leaves the router's e_score_correction_bias at zero; make it non-trivial so a conversion
  # that drops it is caught when our side is compared with this model.
  gen = torch.Generator().manual_seed(args.seed + 1)
  with torch.no_grad():
    for mod in model.modules():
      if isinstance(mod, hf_kimi.KimiLinearTopkRouter):
        mod.e_score_correction_bias.copy_(0.04 * torch.randn(mod.num_experts, generator=gen))
  return model


def time_runs(fn, runs: int) -> list[float]:
  fn()  # warm-up: allocator, one-time kernel selection, logging
  out = []
  for _ in range(runs):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model-dir", type=pathlib.Path, help="load this HF checkpoint instead of building one")
  parser.add_argument("--save-dir", type=pathlib.Path, help="save_pretrained the benchmarked model here")
  parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("runs/reference/bench_transformers.json"))
  parser.add_argument("--prefill-tokens", type=int, default=512)
  parser.add_argument("--decode-tokens", type=int, default=64)
  parser.add_argument("--runs", type=int, default=7)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--vocab-size", type=int, default=4096)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for name in ("prefill_tokens", "decode_tokens", "runs", "threads"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

  check_environment()
  torch.set_num_threads(args.threads)
  model = build_model(args)
  if args.save_dir is not None:
    model.save_pretrained(args.save_dir)
    print(f"saved the model to {args.save_dir}")
  cfg = model.config
  n_params = sum(p.numel() for p in model.parameters())

  gen = torch.Generator().manual_seed(args.seed + 2)
  prompt = torch.randint(3, cfg.vocab_size, (1, args.prefill_tokens), generator=gen)

  @torch.inference_mode()
  def prefill():
    return model(input_ids=prompt, use_cache=True, logits_to_keep=1)

  @torch.inference_mode()
  def decode(first):
    # Each call starts from a fresh prefilled cache (outside the timed region) so every run decodes
    # the same positions.
    cache, token = first.cache, first.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(args.decode_tokens):
      out = model(input_ids=token, cache=cache, use_cache=True)
      cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - t0

  prefill_s = time_runs(prefill, args.runs)
  decode(prefill())  # warm-up
  decode_s = [decode(prefill()) for _ in range(args.runs)]

  result = {
      "what": "HF transformers KimiLinearForCausalLM, float32, CPU torch fallbacks (no fla/triton)",
      "transformers": transformers.__version__, "torch": torch.__version__,
      "python": platform.python_version(), "cpu_count": os.cpu_count(), "threads": args.threads,
      "loadavg_at_end": os.getloadavg(),
      "model": {"source": str(args.model_dir) if args.model_dir else f"random init (seed {args.seed})",
                "parameters": n_params, "layer_types": cfg.layer_types,
                "mlp_layer_types": cfg.mlp_layer_types, "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size, "kda_heads": cfg.linear_num_heads,
                "kda_head_dim": cfg.linear_head_dim, "experts": cfg.num_local_experts,
                "experts_per_token": cfg.num_experts_per_tok},
      "prefill": {"batch": 1, "tokens": args.prefill_tokens, "runs_s": prefill_s,
                  "median_s": statistics.median(prefill_s), "min_s": min(prefill_s),
                  "tokens_per_s": args.prefill_tokens / statistics.median(prefill_s),
                  "tokens_per_s_best": args.prefill_tokens / min(prefill_s)},
      "decode": {"batch": 1, "context_tokens": args.prefill_tokens, "new_tokens": args.decode_tokens,
                 "runs_s": decode_s, "median_s": statistics.median(decode_s), "min_s": min(decode_s),
                 "tokens_per_s": args.decode_tokens / statistics.median(decode_s),
                 "tokens_per_s_best": args.decode_tokens / min(decode_s),
                 "ms_per_token": 1e3 * statistics.median(decode_s) / args.decode_tokens},
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(result, indent=2) + "\n")
  print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} threads, "
        f"{n_params / 1e6:.2f} M parameters, float32, CPU")
  pre, dec = result["prefill"], result["decode"]
  runs_ms = lambda xs: ", ".join(f"{x * 1e3:.1f}" for x in xs)
  print(f"prefill  {args.prefill_tokens} tokens, batch 1: median {pre['median_s'] * 1e3:8.1f} ms -> "
        f"{pre['tokens_per_s']:8.1f} tokens/s (best {pre['tokens_per_s_best']:.1f})  "
        f"(runs: {runs_ms(prefill_s)} ms)")
  print(f"decode   {args.decode_tokens} tokens after {args.prefill_tokens}, batch 1: median "
        f"{dec['median_s'] * 1e3:8.1f} ms -> {dec['tokens_per_s']:8.1f} tokens/s, "
        f"{dec['ms_per_token']:.2f} ms/token (best {dec['tokens_per_s_best']:.1f} tokens/s)  "
        f"(runs: {runs_ms(decode_s)} ms)")
  print(f"wrote {args.json}; load average at the end: {result['loadavg_at_end'][0]:.2f} "
        "(other processes on these cores inflate the timings)")


if __name__ == "__main__":
  main()
