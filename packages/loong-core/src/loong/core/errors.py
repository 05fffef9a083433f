"""User-facing errors: one clear line, no traceback wall."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LoongError(Exception):
    """An error caused by the user's input (config, data, paths) rather than a bug.

    The CLI prints these as a single ``error: ...`` line and exits with status 2.
    """


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """Return the candidate most similar to ``name``, or None when nothing is close."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return found[0] if found else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ``; did you mean 'x'?`` suffix for error messages (empty when nothing is close)."""
    match = closest(name, candidates)
    return f"; did you mean '{match}'?" if match else ""
