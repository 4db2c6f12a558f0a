"""A tiny Kimi-Linear for tests: 4 layers (KDA, MLA, KDA, MLA), width 32, 4 experts of which 2 routed."""

from configs import base


def get_config():
  c = base.get_config()
  c.model_name = "tiny"
  c.vocab_size = 64
  c.hidden_size = 32
  c.num_hidden_layers = 4
  c.intermediate_size = 48
  c.kda_layers = [1, 3]
  c.full_attn_layers = [2, 4]
  c.kda_num_heads = 2
  c.kda_head_dim = 8
  c.num_attention_heads = 2
  c.kv_lora_rank = 8
  c.qk_nope_head_dim = 8
  c.qk_rope_head_dim = 4
  c.v_head_dim = 8
  c.first_k_dense_replace = 1
  c.num_experts = 4
  c.num_experts_per_tok = 2
  c.moe_intermediate_size = 16
  c.num_shared_experts = 1
  c.bos_token_id = 1
  c.eos_token_id = 2
  c.pad_token_id = 0
  c.max_num_segments = 4
  c.max_cache_length = 32
  return c
