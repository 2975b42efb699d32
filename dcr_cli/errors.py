"""Errors that the CLI turns into one line on stderr and a meaningful exit code.

Exit codes (also documented in the README; ``dcr_cli/cli/common.py::exit_code_of`` is the one mapping):
  0    success
  1    a check ran and found a mismatch (``dcr verify``, ``dcr check``)
  2    bad input: unreadable, corrupt or incompatible delta, wrong base, bad arguments or usage, an I/O error
  3    conflict: another writer holds the lock, or a version already exists
  4    not ready yet: a precondition that time may fix (``dcr commit`` still lacks acknowledgements)
  70   internal error: an exception dcr did not expect, i.e. a bug in dcr (one line says so;
       ``DCR_TRACEBACK=1`` prints the traceback as well)
  130  interrupted (Ctrl-C)
Every failure prints exactly one line on stderr, ``dcr: error: ...`` (``dcr: internal error: ...`` for 70).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
EXIT_CONFLICT = 3
EXIT_NOT_READY = 4
EXIT_INTERNAL = 70  # EX_SOFTWARE (sysexits.h)
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class DcrError(Exception):
    """Any failure dcr reports to the user. The message is one line and says what to do."""

    exit_code = EXIT_BAD_INPUT


class FormatError(DcrError):
    """The delta (manifest or block) is malformed, truncated, tampered or of an unknown version."""


class IntegrityError(FormatError):
    """A digest or length did not match what the manifest promises."""


class IncompatibleError(DcrError):
    """The inputs do not fit together: checkpoints differ in layout, or a receiver is not at the base."""


class ConflictError(DcrError):
    """Someone else is writing the same thing: a held lock, or a version that already exists."""

    exit_code = EXIT_CONFLICT


class NotReadyError(DcrError):
    """A precondition that time may fix is not met yet (e.g. missing acknowledgements); retry later."""

    exit_code = EXIT_NOT_READY


class VerifyFailed(DcrError):
    """Verification ran to completion and found tensors that do not match."""

    exit_code = EXIT_MISMATCH
