"""Errors that the CLI turns into one line on stderr and a meaningful exit code.

Exit codes (also documented in the README):
  0  success
  1  a check ran and found a mismatch (``dcr verify``)
  2  bad input: unreadable, corrupt or incompatible delta, wrong base, bad arguments
  3  conflict: another writer holds the lock, or a version already exists
  4  not ready yet: a precondition that time may fix (``dcr commit`` still lacks acknowledgements)
"""

from __future__ import annotations


class DcrError(Exception):
    """Any failure dcr reports to the user. The message is one line and says what to do."""

    exit_code = 2


class FormatError(DcrError):
    """The delta (manifest or block) is malformed, truncated, tampered or of an unknown version."""


class IntegrityError(FormatError):
    """A digest or length did not match what the manifest promises."""


class IncompatibleError(DcrError):
    """The inputs do not fit together: checkpoints differ in layout, or a receiver is not at the base."""


class ConflictError(DcrError):
    """Someone else is writing the same thing: a held lock, or a version that already exists."""

    exit_code = 3


class NotReadyError(DcrError):
    """A precondition that time may fix is not met yet (e.g. missing acknowledgements); retry later."""

    exit_code = 4


class VerifyFailed(DcrError):
    """Verification ran to completion and found tensors that do not match."""

    exit_code = 1
