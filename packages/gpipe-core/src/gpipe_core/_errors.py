"""Small helpers for the errors gpipe raises and passes on, written once.

This module knows nothing of pipelines: it formats and annotates exceptions.
"""

from __future__ import annotations

import sys

__all__ = ["add_note", "describe_error"]


def describe_error(error: BaseException) -> str:
    """``Type: message``, also for an exception whose ``str()`` raises (then the message
    says so, and the type still travels)."""
    try:
        text = str(error)
    except Exception as unprintable:
        text = f"<the message could not be printed: {type(unprintable).__name__}>"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error``'s notes (shown under its traceback) on Python 3.11+;
    nothing on 3.10, which has no notes.

    The method is looked up and called here, not kept in the caller's frame: a bound
    method held there would tie the exception, its traceback and every tensor the frames
    hold into a reference cycle.
    """
    if sys.version_info >= (3, 11):
        error.add_note(note)
