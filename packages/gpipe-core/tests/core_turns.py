"""Making a pipeline's runs one turn in tests (``LocalTransport.one_turn``)."""

from __future__ import annotations

from gpipe_core import GPipe
from gpipe_core._transport import LocalTransport

KINDS = ("forward", "backward", "input", "weight")


def measured_short(pipe: GPipe) -> LocalTransport:
    """Count every action of ``pipe`` (each partition, each kind) as measured short, as
    runs of its tiny layers measure them unless the machine hiccups: its next runs on the
    CPU are one turn, in the calling thread. Returns its transport."""
    transport = pipe._placement.transport()
    assert isinstance(transport, LocalTransport)
    transport.slow = {(j, kind): 0 for j in range(len(pipe.partitions)) for kind in KINDS}
    return transport
