"""The bounded wait for collectives made outside a run (data-parallel average, shared
replicas): the bound is passed on, and a missing rank becomes one clear error."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from gpipe_core.transport._collective import wait_collective


class Work:
    """A stand-in for ``dist.Work``: records how it was waited for; may fail."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[tuple[Any, ...]] = []

    def wait(self, *args: Any) -> bool:
        self.calls.append(args)
        if self.error is not None:
            raise self.error
        return True


def test_the_timeout_bounds_the_wait_and_none_does_not() -> None:
    bounded, unbounded = Work(), Work()
    wait_collective(bounded, 2.5, "x")  # type: ignore[arg-type]
    wait_collective(unbounded, None, "x")  # type: ignore[arg-type]
    assert bounded.calls == [(datetime.timedelta(seconds=2.5),)]
    assert unbounded.calls == [()]


def test_a_missing_rank_is_a_timeout_error_naming_what_waited() -> None:
    work = Work(RuntimeError("Connection closed by peer"))
    with pytest.raises(TimeoutError) as raised:
        wait_collective(work, 3.0, "the data-parallel replicas did not all end the step")  # type: ignore[arg-type]
    message = str(raised.value)
    assert message == (
        "the data-parallel replicas did not all end the step within 3.0 s, or one is gone "
        "(Connection closed by peer)"
    )
    assert isinstance(raised.value.__cause__, RuntimeError)
