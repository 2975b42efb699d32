"""Readers of checkpoints: each yields canonical tensors or regions of them as integer views."""
