"""The layer pattern of Kimi-Linear-48B-A3B at tiny widths, for ahead-of-time compile tests.

Everything structural comes from configs/kimi_linear_48b_a3b.py: 27 layers, MLA at [4, 8, 12, 16, 20,
24, 27] and KDA elsewhere, layer 1 with the dense FFN and MoE after it, a shared expert, so the six
KDA x3 + MLA groups and the KDA, KDA, MLA tail are all there. Only widths, counts and the token ids
shrink, small enough to compile in seconds; head and expert counts are 4 and 8 so that `tensor` and
`expert` mesh axes of 2 (or 4) divide them. float32, as the numerics tests compare in float32.
"""

from configs import kimi_linear_48b_a3b


def get_config():
  c = kimi_linear_48b_a3b.get_config()
  c.model_name = "kimi-linear-48b-pattern-small"
  c.dtype = c.weight_dtype = "float32"
  c.vocab_size = 256
  c.bos_token_id, c.eos_token_id, c.pad_token_id = 1, 2, 0
  c.hidden_size, c.intermediate_size = 64, 128
  c.kda_num_heads, c.kda_head_dim = 4, 16
  c.num_attention_heads, c.kv_lora_rank = 4, 16
  c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim = 16, 8, 16
  c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size = 8, 2, 32
  c.max_num_segments, c.max_cache_length = 2, 64
  c.batch_size, c.seq_len = 4, 64
  return c
