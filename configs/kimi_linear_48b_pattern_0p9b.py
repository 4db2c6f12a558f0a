"""The 0.9B test model of the lent TPU runs (issue 35): Kimi-Linear-48B-A3B's layer pattern at hidden 1024.

Everything structural comes from configs/kimi_linear_48b_a3b.py: 27 layers, MLA at [4, 8, 12, 16, 20,
24, 27] and KDA elsewhere, layer 1 with the dense FFN and MoE after it, a shared expert. Widths: hidden
1024, 8 KDA heads and 8 MLA heads of the 48B head sizes (128; rope 64, kv_lora_rank 512), 16 experts of
which 2 are routed per token (expert width 512, dense FFN 4096), vocabulary 32000. bfloat16.
About 0.9 billion parameters (1.8 GB in bf16, 3.6 GB in f32), of which about 0.3 billion are active
per token; random weights are what the device checks run (tools/bench/e2e_device_check.sh).
"""

from configs import kimi_linear_48b_a3b


def get_config():
  c = kimi_linear_48b_a3b.get_config()
  c.model_name = "kimi-linear-48b-pattern-0p9b"
  c.vocab_size = 32000
  c.bos_token_id, c.eos_token_id, c.pad_token_id = 1, 2, 0
  c.hidden_size, c.intermediate_size = 1024, 4096
  c.kda_num_heads, c.kda_head_dim = 8, 128
  c.num_attention_heads = 8
  c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size = 16, 2, 512
  c.max_cache_length = 8192 + 64
  return c
