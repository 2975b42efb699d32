"""BLAKE3 digests, the only hash in the format (32 bytes, lowercase hex)."""

from __future__ import annotations

import re
from typing import TypeGuard

import blake3
import numpy as np

DIGEST_HEX_LEN = 64
_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_HEX_LEN}}}")

# Inputs above this size are hashed with BLAKE3's own thread pool.
_PARALLEL_THRESHOLD = 8 << 20


def digest_bytes(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """Digest of a byte string, or of an array's raw little-endian C-order bytes."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    threads = blake3.blake3.AUTO if size >= _PARALLEL_THRESHOLD else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


class StreamingDigest:
    """Incremental digest: feeding the pieces of a byte string in order gives its digest."""

    def __init__(self) -> None:
        self._h = blake3.blake3(max_threads=blake3.blake3.AUTO)

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def is_digest(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None
