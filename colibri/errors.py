"""User-facing errors.

Every error a user can cause (bad path, damaged file, unsupported model, ...)
derives from `ColibriError`. The CLI catches `ColibriError`, prints
`colibri: error: <str(exc)>` and exits non-zero without a traceback, so the
message must stand on its own as one line. Anything that is *not* a
ColibriError is a bug in colibri and keeps its traceback.
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base class for every error meant to be shown to the user as one line."""

    def __str__(self) -> str:
        # The CLI prints str(exc) after "colibri: error: "; an embedded newline
        # (e.g. from a wrapped OSError or JSON message) would break that
        # contract, so collapse all whitespace runs into single spaces.
        return " ".join(super().__str__().split())


class SlotBusyError(ColibriError):
    """A KV slot's cache was to be saved, loaded or erased while a request holds the slot."""


class ContainerError(ColibriError):
    """A .coli container cannot be written, opened, validated or read."""


class StageLostError(ColibriError):
    """A cluster stage's process died mid-step: every request in flight lost its K/V on that stage
    (colibri/cluster)."""
