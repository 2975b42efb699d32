"""Delta directories: writing one (blocks, then the manifest last) and reading one back."""

from .reader import Delta
from .writer import DeltaWriter

__all__ = ["Delta", "DeltaWriter"]
