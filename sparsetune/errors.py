"""User-facing errors.

Anything a user can cause (bad model name, missing weights, bad flags) raises
`SparsetuneError`. The CLI prints its message as one line and exits non-zero,
with no traceback; anything else escaping is a bug and keeps its traceback.
"""

from __future__ import annotations


class SparsetuneError(Exception):
    """An error caused by input; the message says what is wrong and how to fix it."""

    exit_code: int = 2


class OutOfMemory(SparsetuneError):
    """A KV pool (with a flow's fields) larger than the device memory left: what else holds memory
    (another engine in the same process) may be what is in the way."""
