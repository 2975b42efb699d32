"""Producers: turn two states of a model (checkpoints, trainer shards) into a delta."""

from .engine import diff

__all__ = ["diff"]
