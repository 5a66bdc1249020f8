"""Bounded waits for the collectives gpipe makes outside a run (data-parallel averaging,
shared replicas' gradients and drift): one way to wait, one error when a rank is missing.

This module knows nothing of partitions, schedules or transports.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["wait_collective"]


def wait_collective(work: dist.Work | None, timeout: float | None, what: str) -> None:
    """Wait for the asynchronous collective ``work`` at most ``timeout`` seconds (None: no
    bound); a ``TimeoutError`` naming ``what`` if it does not end in time or a rank is gone.

    ``what`` says which ranks did not take part, e.g. ``"the data-parallel replicas did not
    all end the step"``.
    """
    assert work is not None, "an asynchronous collective gives its work"
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        raise TimeoutError(f"{what} within {timeout} s, or one is gone ({error})") from error
