"""Input data: corpus readers, the held-out split, packing with segment ids, batches (`pipeline`); tokenizers."""
