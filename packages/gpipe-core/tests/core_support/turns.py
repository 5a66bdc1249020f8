"""Making a pipeline's runs one turn in tests (``Turns.one_turn``), or its actions overlap."""

from __future__ import annotations

from gpipe_core import GPipe, Phase
from gpipe_core.run._turns import LONG_AFTER, Turns
from gpipe_core.transport._transport import LocalTransport

KINDS = tuple(kind for kind in Phase if kind.is_action)


def measured_short(pipe: GPipe, hand_over: bool = False) -> Turns:
    """Count every action of ``pipe`` (each partition, each kind) as measured short, as
    runs of its tiny layers measure them unless the machine hiccups: its next runs on the
    CPU are one turn, in the calling thread. Returns its turns.

    Without ``hand_over`` a run never hands over to the workers (the tests' layers never
    wait for another's): a busy machine's hiccup in an action would otherwise make the
    workers take the rest of the run."""
    transport = pipe._placement.transport()
    assert isinstance(transport, LocalTransport)
    turns = Turns.of(transport)
    turns.slow = {(j, kind): 0 for j in range(len(pipe.partitions)) for kind in KINDS}
    if not hand_over:
        turns.hand_over_after = None
    return turns


def measured_long(pipe: GPipe) -> Turns:
    """Count every action of ``pipe`` as measured long: on the CPU its workers then run
    their actions at the same time, as those of larger layers do, instead of taking turns
    (what tiny test layers measure). Returns its turns."""
    transport = pipe._placement.transport()
    assert isinstance(transport, LocalTransport)
    turns = Turns.of(transport)
    turns.slow = {(j, kind): LONG_AFTER for j in range(len(pipe.partitions)) for kind in KINDS}
    return turns
