"""Options the store commands share: fsspec storage options, rates, durations."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import click

from ..errors import DcrError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def storage_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """-S/--storage-option KEY=VALUE, passed to the fsspec filesystem (VALUE parsed as JSON when it is JSON).

    Credentials normally come from the usual sources (environment, ~/.aws, instance roles); values given
    here are never printed.
    """
    return click.option(
        "-S",
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable). "
        "FSSPEC_S3_* environment variables work too.",
    )(fn)


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DcrError(f"--storage-option expects KEY=VALUE, got an option named {key or '?'!r} without '='")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_rate(text: str | None) -> float | None:
    """'50M' -> 50 MiB/s; plain numbers are bytes per second."""
    if text is None:
        return None
    raw = text.strip().lower().removesuffix("/s").removesuffix("b").removesuffix("i")
    unit = raw[-1:] if raw[-1:] in _UNITS and not raw[-1:].isdigit() else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise DcrError(f"--limit-rate {text!r}: give bytes per second, e.g. 50M or 1G") from None
    if not math.isfinite(value) or value <= 0:
        raise DcrError("--limit-rate must be a positive number of bytes per second")
    return value


def parse_duration(text: str) -> float:
    """'90' -> 90 s; '30m', '1h', '2d'."""
    raw = text.strip().lower()
    unit = raw[-1:] if raw[-1:] in _SECONDS and not raw[-1:].isdigit() else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * _SECONDS[unit]
    except ValueError:
        raise DcrError(f"{text!r} is not a duration: use e.g. 0, 90s, 30m, 1h") from None
    if not math.isfinite(value) or value < 0:
        raise DcrError(f"{text!r} is not a duration: use e.g. 0, 90s, 30m, 1h")
    return value
