"""dcr: bit-exact, delta-compressed weight refit for reinforcement learning."""

__version__ = "0.1.0"

__all__ = ["apply", "verify"]


def __getattr__(name: str) -> object:
    # Lazy, so that `dcr --help` does not pay for numpy and fsspec imports.
    if name == "apply":
        from .receivers.checkpoint import apply

        return apply
    if name == "verify":
        from .receivers.verify import verify

        return verify
    raise AttributeError(f"module 'dcr_cli' has no attribute {name!r}")
