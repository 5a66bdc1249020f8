"""A run's session on the placement's transport: begun and finished on every rank, its plan
shared from the first partition's rank, each rank's payload handed over at the end.

This module owns the order of a run's lifecycle calls on the transport (begin, plan,
finish) and what becomes of an error at either end: told to the other ranks, or raised as
theirs. It must not know partitions, schedules or losses: a run's plan and payloads are
values it carries. Within one process every call is the transport's empty one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import add_note
from ._agreement import RanksDisagree
from ._transport import Cancelled, Fields, Plan, Transport

__all__ = ["Session", "run_session", "share_plan"]


class Session:
    """What a run across processes gives every rank: each rank's payload."""

    def __init__(self) -> None:
        #: What this rank gives the others when the run ends.
        self.payload: object = None
        #: What each other rank gave.
        self.payloads: dict[int, Any] = {}


@contextmanager
def run_session(transport: Transport) -> Iterator[Session]:
    """A run, begun and ended on ``transport`` (across processes: on every rank).

    One run at a time (see :class:`~gpipe_core.transport._transport.RunLock`). Across processes,
    the ``with`` block's error is told to the other ranks, which raise a
    :class:`~gpipe_core.RemotePartitionError` naming this rank; if another rank fails, the block's
    waits end and the ``with`` statement raises that error; ranks called with
    different run fields all raise the same :class:`RanksDisagree`.
    """
    transport.begin()
    session = Session()
    try:
        yield session
    except Cancelled:
        transport.finish(None)  # raises the failing rank's error
        raise RuntimeError("the run was cancelled on this rank") from None
    except BaseException as error:
        try:
            transport.finish(error)
        except RanksDisagree as disagreement:
            raise disagreement from None  # the same error on every rank
        except Exception as also:  # the local error stays the one raised
            add_note(error, f"(ending the run on the other ranks failed too: {also})")
        raise
    session.payloads = transport.finish(None, session.payload)


def share_plan(
    transport: Transport, plan: Plan | None, fields: Fields, *, first: bool, check: bool
) -> Plan:
    """The run's ``plan``, given by the first partition's rank (``first``: this one) to
    every other rank; across processes the run's ``fields`` go with it, and the other ranks
    check that theirs are the same (see :mod:`gpipe_core.transport._agreement`), if
    ``check``."""
    checked = fields if check else ()
    if first:
        assert plan is not None
        transport.send_plan(plan, checked)
        return plan
    return transport.receive_plan(checked)
