"""dcr: bit-exact, delta-compressed weight refit for reinforcement learning."""

__version__ = "0.1.0"
