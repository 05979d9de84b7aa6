"""The training loop and the optimizer rules."""
