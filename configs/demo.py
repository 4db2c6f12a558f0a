"""The demo model: 6 layers (KDA x2, MLA, KDA x2, MLA), width 256, 4 experts (2 routed) + 1 shared;
special ids pad=0, bos=2, eos=3 as written by tools.train_tokenizer."""

from configs import base


def get_config():
  c = base.get_config()
  c.model_name = "demo"
  c.vocab_size = 1024
  c.hidden_size = 256
  c.num_hidden_layers = 6
  c.intermediate_size = 512
  c.kda_layers = [1, 2, 4, 5]
  c.full_attn_layers = [3, 6]
  c.kda_num_heads = 4
  c.kda_head_dim = 64
  c.num_attention_heads = 4
  c.kv_lora_rank = 64
  c.qk_nope_head_dim = 32
  c.qk_rope_head_dim = 16
  c.v_head_dim = 32
  c.first_k_dense_replace = 1
  c.num_experts = 4
  c.num_experts_per_tok = 2
  c.moe_intermediate_size = 64
  c.num_shared_experts = 1
  c.bos_token_id = 2
  c.eos_token_id = 3
  c.pad_token_id = 0
  c.max_num_segments = 8
  c.max_cache_length = 512
  return c
