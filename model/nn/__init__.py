"""The Kimi-Linear model in Flax NNX: layers, the KDA and MLA mixers, MoE, decode caches, the causal LM."""
