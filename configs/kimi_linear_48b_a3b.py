"""Kimi-Linear-48B-A3B: the real dimensions (the released config.json; docs/checkpoints.md), bfloat16.

49,122,681,728 parameters (checked by tests/model/test_config.py without allocating them).
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model_name = "kimi-linear-48b-a3b"
  # The architecture values are base's defaults; restated here so this file reads on its own.
  c.vocab_size = 163840
  c.hidden_size = 2304
  c.num_hidden_layers = 27
  c.intermediate_size = 9216
  c.full_attn_layers = [4, 8, 12, 16, 20, 24, 27]
  c.kda_layers = [i for i in range(1, 28) if i not in c.full_attn_layers]
  c.kda_num_heads = 32
  c.kda_head_dim = 128
  c.num_attention_heads = 32
  c.kv_lora_rank = 512
  c.qk_nope_head_dim = 128
  c.qk_rope_head_dim = 64
  c.v_head_dim = 128
  c.num_experts = 256
  c.num_experts_per_tok = 8
  c.moe_intermediate_size = 1024
  c.routed_scaling_factor = 2.446
  c.dtype = "bfloat16"
  c.weight_dtype = "bfloat16"
  c.max_cache_length = 4096
  return c
