"""BLAKE3 digests, the only hash in the format (32 bytes, lowercase hex)."""

from __future__ import annotations

import re
from typing import TypeGuard

import blake3
import numpy as np

DIGEST_HEX_LEN = 64
DIGEST_SIZE = 32  # bytes of a full digest
_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_HEX_LEN}}}")
_HEX_DIGESTS: dict[int, re.Pattern[str]] = {DIGEST_HEX_LEN: _DIGEST}

# Inputs above this size are hashed with BLAKE3's own thread pool.
_PARALLEL_THRESHOLD = 8 << 20


def digest_bytes(data: bytes | bytearray | memoryview | np.ndarray, length: int = DIGEST_SIZE) -> str:
    """Digest of a byte string, or of an array's raw little-endian C-order bytes.

    ``length`` < 32 gives BLAKE3's shorter output, which is the prefix of the 32-byte one (delta-v2 §4.2).
    """
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    threads = blake3.blake3.AUTO if size >= _PARALLEL_THRESHOLD else 1
    return blake3.blake3(data, max_threads=threads).hexdigest(length=length)


class StreamingDigest:
    """Incremental digest: feeding the pieces of a byte string in order gives its digest."""

    def __init__(self, threads: bool = True) -> None:
        """``threads``: use BLAKE3's own thread pool (False where the caller runs one digest per core)."""
        self._h = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def is_digest(value: object, hex_len: int = DIGEST_HEX_LEN) -> TypeGuard[str]:
    """Whether ``value`` is ``hex_len`` lowercase hex characters (64: a full digest)."""
    pattern = _HEX_DIGESTS.get(hex_len)
    if pattern is None:
        pattern = _HEX_DIGESTS.setdefault(hex_len, re.compile(f"[0-9a-f]{{{hex_len}}}"))
    return isinstance(value, str) and pattern.fullmatch(value) is not None
