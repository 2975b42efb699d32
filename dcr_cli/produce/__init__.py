"""Producers: turn two states of a model (checkpoints, trainer shards, live tensors) into a delta.

plan.py plans a diff from metadata; engine.py executes any plan over two sides.
"""

from .engine import diff

__all__ = ["diff"]
