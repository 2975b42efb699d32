"""dcr: bit-exact, delta-compressed weight refit for reinforcement learning."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Store API, imported on first use so that `import dcr_cli` stays light.
    if name in _STORE_API:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module 'dcr_cli' has no attribute {name!r}")


_STORE_API = ("push", "pull", "pull_since", "commit", "acknowledge", "status", "log", "gc", "check", "open_delta")
