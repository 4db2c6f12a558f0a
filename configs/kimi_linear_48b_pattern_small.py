"""The layer pattern of Kimi-Linear-48B-A3B at tiny widths, for ahead-of-time compile tests.

27 layers, MLA at [4, 8, 12, 16, 20, 24, 27] and KDA elsewhere, layer 1 with the dense FFN and MoE
after it (as configs/kimi_linear_48b_a3b.py), so the six KDA x3 + MLA groups and the KDA, KDA, MLA
tail are all there; widths are small enough to compile in seconds. Head and expert counts are 4 and
8 so that `tensor` and `expert` mesh axes of 2 (or 4) divide them.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model_name = "kimi-linear-48b-pattern-small"
  c.vocab_size = 256
  c.hidden_size = 64
  c.num_hidden_layers = 27
  c.intermediate_size = 128
  c.full_attn_layers = [4, 8, 12, 16, 20, 24, 27]
  c.kda_layers = [i for i in range(1, 28) if i not in c.full_attn_layers]
  c.kda_num_heads = 4
  c.kda_head_dim = 16
  c.num_attention_heads = 4
  c.kv_lora_rank = 16
  c.qk_nope_head_dim = 16
  c.qk_rope_head_dim = 8
  c.v_head_dim = 16
  c.first_k_dense_replace = 1
  c.num_experts = 8
  c.num_experts_per_tok = 2
  c.moe_intermediate_size = 32
  c.num_shared_experts = 1
  c.bos_token_id = 1
  c.eos_token_id = 2
  c.pad_token_id = 0
  c.max_num_segments = 2
  c.max_cache_length = 64
  c.batch_size = 4
  c.seq_len = 64
  return c
