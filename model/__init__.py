"""The Kimi-Linear host (see model/README.md): config, partitioning, the model, checkpoints, loading, engines, training."""
