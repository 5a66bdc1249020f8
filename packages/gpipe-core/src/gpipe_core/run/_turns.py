"""The workers' turns on the CPU: when a short action may run, and when a run is one turn.

**Short actions take turns on the CPU.** Python threads share one interpreter lock,
which every PyTorch operator releases and takes again: two workers running small
operators at the same time hand it to each other at almost every operator, and each
hand-over wakes a thread (on a 2-core machine, two threads each running a tiny
``Linear``'s forward and backward passes took 2 x as long as one thread running both
in turn). So where every partition is on the CPU, a short action runs only in its
worker's turn: one worker at a time runs short actions, keeps its turn while its next
action is ready, and gives it up when it waits for a message (or its list ends, or its
next action is long), waking one worker whose action is ready. Long actions (and
every action off the CPU) never wait for a turn, so partitions that compute for longer
still overlap.

An action (a partition and a kind: the forward pass of partition 1, say) is long once
it computed for at least :data:`SHORT_ACTION` :data:`LONG_AFTER` times in a row, and
short again after one shorter time; never measured, it is short. A long action takes
a turn every :data:`PROBE_EVERY` times if nobody holds it (it never waits for one),
so that it is measured alone. The measurements are kept from run to run
(:meth:`Turns.of` keeps one :class:`Turns` with the transport). An action that has kept
the turn for :data:`TAKE_OVER_AFTER` loses it to a waiting worker, so a turn never waits
on an action that waits for another worker. Once every action of a run is measured short
(:meth:`Turns.one_turn`), the run is one turn: the calling thread runs all of them, and
no worker thread computes (a first run, which measures them, runs on the workers; one
worker's thread, asleep, watches for an action that blocks, and hands the rest of the run
to the workers after :data:`HAND_OVER_AFTER`, see :mod:`gpipe_core.run._runner`).
Whatever the turns, every worker runs its own list in order, so the results are those of
any other interleaving.

The turns are the runner's: it asks for a turn before each action (:meth:`Turns.take_turn`),
tells how long the action computed (:meth:`Turns.took`), gives the turn up when a worker's
list ends (:meth:`Turns.end_turn`), and asks whether a run is one turn
(:meth:`Turns.one_turn`). A wait for a message between worker threads gives the turn up
meanwhile through the transport's :class:`~gpipe_core.transport._transport.Turnstile`,
which :class:`Turns` is; across processes there are no turns.

It must not know what a partition computes, nor which messages the transport carries
beyond whether one has arrived.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import cast

from ..schedule._action import Action
from ..transport._transport import Cancelled, LocalTransport, Message, MessageKey, Transport
from ._order import action_kinds

__all__ = [
    "HAND_OVER_AFTER",
    "LONG_AFTER",
    "PROBE_EVERY",
    "SHORT_ACTION",
    "TAKE_OVER_AFTER",
    "Turns",
]

#: An action that computes for less than this (seconds) is short: on the CPU, short
#: actions of the workers take turns (see this module).
SHORT_ACTION = 2e-4
#: How many times in a row an action (a partition's forward pass, say) must take at least
#: :data:`SHORT_ACTION` to count as long: one late time, the machine busy elsewhere, does
#: not make it long.
LONG_AFTER = 2
#: A long action takes a turn every this many times, if nobody holds it, to be measured
#: alone: measured among running workers, a short action can look long (they hand each
#: other the interpreter lock at every operator), and this lets it come back.
PROBE_EVERY = 16
#: A worker whose action has kept the turn this long (seconds) keeps it no longer: a
#: worker waiting for a turn takes it. The action is long, or blocked until another
#: worker moves (a layer waiting for another partition's layer): turns never make a
#: worker wait for longer than this on an action of another.
TAKE_OVER_AFTER = 10 * SHORT_ACTION
#: An action of a run in one turn (the calling thread runs every action, see
#: :meth:`Turns.one_turn`) that has run this long (seconds) hands the rest of the run
#: over to the workers: it may wait for something the serial order runs later (a layer
#: waiting for another partition's layer). Longer than :data:`TAKE_OVER_AFTER`: a hand-over
#: wakes every worker, and one turn's actions are short (a blocked one is measured long, and
#: the next runs are no longer one turn).
HAND_OVER_AFTER = 0.05


class Turns:
    """The turns of the workers of one pipeline in this process, and their measurements
    (see this module). Get them with :meth:`of`.

    Args:
        transport: the transport between the workers' threads (None: no turns, as across
            processes); its lock, conditions and mailbox are the turns' too.
    """

    #: How long (seconds) an action of a run in one turn may run before the run is handed
    #: over to the workers (:data:`HAND_OVER_AFTER`); None: never (for layers known never
    #: to wait for another's, as tests make them).
    hand_over_after: float | None = HAND_OVER_AFTER

    def __init__(self, transport: LocalTransport | None = None) -> None:
        self.transport = cast(LocalTransport, transport)
        #: Whether the current run takes turns (every partition on the CPU).
        self.on = False
        if transport is not None:
            self.lock = transport.lock
            self.arrived = transport.arrived
            self.waiting: dict[int, tuple[MessageKey | None, bool]] = transport.waiting
            self.messages: dict[MessageKey, Message] = transport.messages
        #: The thread whose turn it is (None: nobody's), and when its current action
        #: began (``time.perf_counter()``).
        self.holder: int | None = None
        self.since = 0.0
        #: How many times in a row each action (partition, kind) computed for at least
        #: :data:`SHORT_ACTION`.
        self.slow: dict[tuple[int, str], int] = {}

    @classmethod
    def of(cls, transport: Transport) -> Turns:
        """The turns of the workers whose messages ``transport`` carries, for the run it
        was prepared for (:meth:`~gpipe_core.transport._transport.Transport.prepare`):
        made on first use and kept with the transport, so that the measurements last from
        run to run; on where every partition is on the CPU. Across processes: none."""
        if not isinstance(transport, LocalTransport):
            return NO_TURNS
        turns = transport.turnstile
        if not isinstance(turns, Turns):
            turns = cls(transport)
            transport.turnstile = turns
        turns.on = transport.one_cpu
        return turns

    def take_turn(self, partition: int, kind: str) -> None:
        """Before an action of ``kind`` on ``partition``: wait for this worker's turn if
        the action is short and the run takes turns.

        Raises:
            Cancelled: the run was cancelled while waiting.
        """
        if not self.on:
            return
        me = threading.get_ident()
        slow = self.slow.get((partition, kind), 0)
        # A long action takes no turn, but is measured alone every PROBE_EVERY times if the
        # turn is free then: it never waits for one.
        probe = slow >= LONG_AFTER and slow % PROBE_EVERY == 0
        if slow >= LONG_AFTER and not probe:
            if self.holder == me:
                self.end_turn()
            return
        if self.holder == me:
            self.since = time.perf_counter()
            return
        with self.lock:
            if not self.free():
                if probe:
                    return
                self.waiting[partition] = (None, True)
                try:
                    while not self.free():
                        if self.transport.cancelled:
                            raise Cancelled
                        self.arrived[partition].wait(self.patience())
                finally:
                    del self.waiting[partition]
            self.holder, self.since = me, time.perf_counter()

    def free(self) -> bool:
        """Whether a worker may take the turn now (the transport's lock held): nobody's,
        or held by an action for :data:`TAKE_OVER_AFTER` already."""
        return self.holder is None or time.perf_counter() - self.since >= TAKE_OVER_AFTER

    def patience(self) -> float:
        """How long a worker waiting for a turn sleeps before it looks again (the
        transport's lock held): until the holder's action has kept the turn for
        :data:`TAKE_OVER_AFTER`."""
        if self.holder is None:
            return TAKE_OVER_AFTER
        return max(TAKE_OVER_AFTER - (time.perf_counter() - self.since), SHORT_ACTION / 10)

    def took(self, partition: int, kind: str, seconds: float) -> None:
        """An action of ``kind`` on ``partition`` computed for ``seconds`` (its messages'
        waits excluded): what decides whether it takes turns next time."""
        if not self.on:
            return
        action = (partition, kind)  # only its worker's thread counts it
        self.slow[action] = 0 if seconds < SHORT_ACTION else self.slow.get(action, 0) + 1

    def one_turn(self, actions: Sequence[Sequence[Action]]) -> bool:
        """Whether the whole run of ``actions`` may be one turn: every worker's actions run
        in the calling thread, in :func:`~gpipe_core.run._order.serial_order`,
        handed over to the workers if an action runs for :attr:`hand_over_after` (see
        :meth:`gpipe_core.run._runner._Executor.run_one_turn`); never without turns."""
        if not self.on:
            return False
        slow = self.slow
        # Never measured counts as long here: a first run shows what each action takes.
        return all(
            slow.get((cast(int, j), kind), LONG_AFTER) < LONG_AFTER
            for j, kind in action_kinds(actions)
        )

    def end_turn(self) -> None:
        """This worker stops taking turns (its list ended, it failed, or its next action
        is long): another may go on."""
        if self.holder != threading.get_ident():
            return
        with self.lock:
            self._pass_turn()

    def _pass_turn(self) -> None:
        """Give up the turn (the transport's lock held): wake one worker that waits for a
        turn and can go on with it (one that waits for a message only would not take
        it)."""
        self.holder = None
        for target, (key, turn) in self.waiting.items():
            if turn and (key is None or key in self.messages):
                self.arrived[target].notify()
                return

    # -- the transport's Turnstile (its lock held) -----------------------------------------

    def leave(self) -> bool:
        """Give the calling thread's turn up if it holds it; whether it did."""
        if self.holder != threading.get_ident():
            return False
        self._pass_turn()
        return True

    def hold(self) -> None:
        """The calling thread takes the turn."""
        self.holder, self.since = threading.get_ident(), time.perf_counter()

    def busy(self) -> bool:
        """Whether a worker holds the turn."""
        return self.holder is not None

    def clear(self) -> None:
        """Nobody holds the turn."""
        self.holder = None


#: No turns (across processes).
NO_TURNS = Turns()
