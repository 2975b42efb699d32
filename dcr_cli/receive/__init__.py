"""Receivers: things a delta is applied to (format_spec/receiver-checkpoint.md for checkpoint dirs)."""
