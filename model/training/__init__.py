"""Training: the train state, optimizer and jitted steps (`steps`) and the training loop (`trainer`)."""
