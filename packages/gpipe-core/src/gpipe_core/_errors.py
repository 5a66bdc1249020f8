"""The errors that several layers raise or pass on, and the record of a failure, written once.

:class:`RemotePartitionError` (public, also as ``RemoteStageError``) is what a rank raises
when another rank of its pipeline failed, whether the pipeline was being built
(:mod:`gpipe_core.transport._agreement`) or run (:mod:`gpipe_core.transport._distributed`);
:class:`Failure` is what the failing rank tells the others, in both cases.

This module knows nothing of pipelines: it formats, annotates and records exceptions.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

__all__ = [
    "Failure",
    "RemotePartitionError",
    "RemoteStageError",
    "add_note",
    "describe_error",
]


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


class RemotePartitionError(RuntimeError):
    """Another rank of the pipeline failed: raised on every rank but the failing one, by
    the ranks' agreement while the pipeline is built (``transport._agreement``) and by the
    transport during a run (``transport._distributed``), never by :class:`~gpipe_core.GPipe`
    itself.

    ``RemoteStageError`` is the same class, under the name it had before gpipe called the
    runtime pieces of a pipeline partitions (kept so that ``except RemoteStageError``
    still works).

    Attributes:
        rank: the failing rank (in the pipeline's group).
        where: what it was doing (``'backward of micro-batch 2 on partition 1'``).
        remote_traceback: the failing rank's traceback, as text.
    """

    def __init__(self, rank: int, where: str, summary: str, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} of the pipeline failed in {where}: {summary}")
        self.rank = rank
        self.where = where
        self.remote_traceback = remote_traceback
        if remote_traceback:
            add_note(self, f"The traceback on rank {rank}:\n{remote_traceback.rstrip()}")


RemotePartitionError.__module__ = "gpipe_core"

#: The former name of :class:`RemotePartitionError` (the same class).
RemoteStageError = RemotePartitionError


@dataclass
class Failure:
    """A failure, as the failing rank tells the other ranks of its pipeline (through the
    process group's store while the pipeline is built, in a message while it runs).

    Attributes:
        rank: the failing rank (in the pipeline's group).
        where: what it was doing (``'backward of micro-batch 2 on partition 1'``,
            ``'building the pipeline'``).
        summary: the error, as ``Type: message`` (:func:`describe_error`).
        text: its traceback, as text ('' when it does not travel).
        disagrees: whether it failed because its run fields differ from the first
            partition's rank's (every rank then compares the fields that each sent with
            its last message of the run).
    """

    rank: int
    where: str
    summary: str
    text: str = ""
    disagrees: bool = False

    @classmethod
    def of(cls, rank: int, where: str, error: BaseException, *, disagrees: bool = False) -> Failure:
        """The failure of ``error`` on ``rank``, with its traceback."""
        summary = describe_error(error)
        try:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        except Exception:  # an exception that cannot be printed still travels
            text = "".join(traceback.format_tb(error.__traceback__)) + summary
        return cls(rank, where, summary, text, disagrees)

    def error(self) -> RemotePartitionError:
        """The error the other ranks raise."""
        return RemotePartitionError(self.rank, self.where, self.summary, self.text)
