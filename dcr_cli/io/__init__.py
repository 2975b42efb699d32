"""Shared I/O helpers, used by producers and receivers alike: atomic files, fsync, one worker pool."""
