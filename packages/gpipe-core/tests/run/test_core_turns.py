"""Turns: on the CPU, short actions of the workers run one at a time (``run._turns``), and a
wait for a message between them (``LocalTransport``) gives the turn up meanwhile.

Each test that starts a thread joins it with a bound and checks that it ended; nothing here
asserts a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from core_support.turns import measured_short
from gpipe_core import Action, GPipe
from gpipe_core._stream import CPUStream
from gpipe_core.run import _turns
from gpipe_core.run._turns import LONG_AFTER, PROBE_EVERY, SHORT_ACTION, Turns
from gpipe_core.transport._transport import Cancelled, LocalTransport, MessageKey, outgoing

CPU = torch.device("cpu")
BOUND = 10.0  # seconds any wait here may take before the test fails


def transport_on(devices: list[torch.device]) -> LocalTransport:
    transport = LocalTransport(devices)
    transport.begin()
    streams = [CPUStream] * len(devices)
    transport.prepare(streams, [[CPUStream] for _ in devices], tracer=None)
    return transport


class Worker:
    """A thread running ``work``, keeping what it raised and the turn's holder at its end."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None

        def target() -> None:
            try:
                self.result = work()
            except BaseException as error:
                self.error = error
            finally:
                self.done.set()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(BOUND)
        assert not self.thread.is_alive(), "the worker did not end"


def turn_taker(turns: Turns, partition: int, kind: str = "forward") -> Any:
    """A worker's work: take a turn for an action of ``kind`` on ``partition``, note who
    holds the turn then, and give it up."""

    def work() -> int | None:
        turns.take_turn(partition, kind)
        holder = turns.holder
        turns.end_turn()
        return holder

    return work


def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) until ``condition()`` holds: a thread has reached its wait."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)


@pytest.fixture(autouse=True)
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn is never taken over in these tests (but where a test says otherwise): each
    checks who holds it at points in between, however slowly the machine runs them."""
    monkeypatch.setattr(_turns, "TAKE_OVER_AFTER", 10 * BOUND)


@pytest.fixture
def transport() -> Any:
    transport = transport_on([CPU, CPU])
    yield transport
    transport.cancel()
    transport.reset()
    transport.finish(None)


@pytest.fixture
def turns(transport: LocalTransport) -> Turns:
    return Turns.of(transport)


def test_a_short_action_waits_for_the_turn(transport: LocalTransport, turns: Turns) -> None:
    me = threading.get_ident()
    turns.take_turn(0, "forward")
    assert turns.holder == me

    worker = Worker(turn_taker(turns, 1))
    until(lambda: 1 in transport.waiting)  # it waits for the turn
    assert turns.holder == me and not worker.done.is_set()
    turns.take_turn(0, "backward")  # the holder keeps its turn
    assert turns.holder == me
    turns.end_turn()
    worker.join()
    assert worker.error is None and worker.result == worker.thread.ident
    assert turns.holder is None


def test_a_worker_waiting_for_a_message_gives_its_turn_up_and_gets_it_back(
    transport: LocalTransport, turns: Turns
) -> None:
    key = MessageKey("activations", 0, 0, 1)

    def receiver() -> tuple[int | None, torch.Tensor]:
        turns.take_turn(1, "forward")
        message = transport.receive(key)  # not sent yet: gives the turn up meanwhile
        holder = turns.holder
        turns.end_turn()
        return holder, message.tensors[0]

    worker = Worker(receiver)
    until(lambda: transport.waiting.get(1) == (key, True))
    assert turns.holder is None
    turns.take_turn(0, "forward")  # free: the receiver gave it up
    value = torch.ones(2)
    transport.send(key, outgoing([value], atomic=True, detach=True))
    # The message is there, but the turn is not: the receiver goes on once it is given up.
    assert transport.waiting.get(1) == (key, True) and not worker.done.is_set()
    turns.end_turn()
    worker.join()
    assert worker.error is None
    holder, received = worker.result
    assert holder == worker.thread.ident and torch.equal(received, value)


def test_long_actions_take_no_turn_except_to_be_measured(turns: Turns) -> None:
    turns.take_turn(0, "forward")
    for _ in range(LONG_AFTER):
        turns.took(1, "backward", 10 * SHORT_ACTION)
    long = Worker(lambda: turns.take_turn(1, "backward"))
    long.join()  # while partition 0's worker holds the turn
    assert long.error is None and turns.holder == threading.get_ident()
    # Every PROBE_EVERY times, a long action takes the turn if it is free, to be measured
    # alone; it never waits for it.
    turns.slow[(1, "backward")] = PROBE_EVERY

    probed = turn_taker(turns, 1, "backward")
    busy = Worker(probed)  # the turn is partition 0's worker's: no probe this time
    busy.join()
    assert busy.error is None and busy.result == threading.get_ident()
    turns.end_turn()
    probe = Worker(probed)
    probe.join()
    assert probe.error is None and probe.result == probe.thread.ident
    # One short time makes it short again; one long time alone does not make it long.
    turns.took(1, "backward", 0.0)
    turns.took(1, "backward", 10 * SHORT_ACTION)
    assert turns.slow[(1, "backward")] == 1 < LONG_AFTER


def test_a_holder_whose_next_action_is_long_gives_its_turn_up(turns: Turns) -> None:
    turns.take_turn(0, "forward")
    for _ in range(LONG_AFTER):
        turns.took(0, "backward", 10 * SHORT_ACTION)
    turns.take_turn(0, "backward")
    assert turns.holder is None


def test_cancelling_wakes_a_worker_waiting_for_its_turn(
    transport: LocalTransport, turns: Turns
) -> None:
    turns.take_turn(0, "forward")
    worker = Worker(lambda: turns.take_turn(1, "forward"))
    until(lambda: 1 in transport.waiting)
    transport.cancel()
    worker.join()
    assert isinstance(worker.error, Cancelled)
    transport.reset()
    assert turns.holder is None and not transport.waiting


@pytest.mark.parametrize(
    "devices", [[CPU, torch.device("meta")], [torch.device("meta"), torch.device("meta")]]
)
def test_no_turns_but_on_the_cpu(devices: list[torch.device]) -> None:
    transport = transport_on(devices)
    turns = Turns.of(transport)
    try:
        assert not turns.on
        turns.take_turn(0, "forward")
        assert turns.holder is None
        other = Worker(lambda: turns.take_turn(1, "forward"))
        other.join()
        assert other.error is None and turns.holder is None
    finally:
        transport.finish(None)


def test_a_run_is_one_turn_once_every_action_is_known_short(turns: Turns) -> None:
    actions = [
        [Action(kind, i, j) for i in range(4) for kind in ("forward", "backward")] for j in range(2)
    ]
    assert not turns.one_turn(actions)  # never measured: a first run shows
    kinds = {(j, kind) for j in range(2) for kind in ("forward", "backward")}
    for j, kind in kinds:
        turns.took(j, kind, SHORT_ACTION / 2)
    assert turns.one_turn(actions)
    turns.took(1, "backward", SHORT_ACTION)  # one long time: still short
    assert turns.one_turn(actions)
    turns.took(1, "backward", SHORT_ACTION)  # long now
    assert not turns.one_turn(actions)
    turns.took(1, "backward", 0.0)
    assert turns.one_turn(actions)
    turns.on = False  # off the CPU, or partitions on several devices
    assert not turns.one_turn(actions)
    # Across processes (no turns): never, the others' actions run there.
    assert Turns().one_turn(actions) is False


def assert_plain_gradients(
    pipe: GPipe, plain: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module
) -> None:
    """The pipeline's gradients (of one step) are the plain model's."""
    grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    plain.zero_grad()
    loss_fn(plain(x), y).backward()
    for grad, p in zip(grads, plain.parameters(), strict=True):
        assert torch.allclose(grad, p.grad)  # type: ignore[arg-type]


class Sleep(nn.Module):
    """A layer that computes for ``seconds`` (a sleep) in its forward pass."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


class Fail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_step_measures_its_actions_and_matches_the_plain_model(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    fail = Fail()
    # Partition 0 sleeps in its forward pass (long); partition 1 is tiny (short), by a
    # margin no machine's hiccup bridges.
    monkeypatch.setattr(_turns, "SHORT_ACTION", 0.025)
    model = nn.Sequential(Sleep(0.05), fail, nn.Linear(4, 4))
    plain = nn.Sequential(*(layer for layer in model))
    pipe = GPipe(model, [1, 2], chunks=4, checkpoint="never")
    transport = pipe._placement.transport()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss_fn = nn.MSELoss()
    for _ in range(2):
        pipe.zero_grad()
        pipe.step(x, y, loss_fn, schedule=schedule)
    assert isinstance(transport, LocalTransport)
    turns = Turns.of(transport)
    assert turns.on
    assert turns.slow[(0, "forward")] >= LONG_AFTER
    assert turns.slow[(1, "forward")] < LONG_AFTER
    assert turns.slow[(1, "backward")] < LONG_AFTER
    assert_plain_gradients(pipe, plain, x, y, loss_fn)
    # A failing action gives its turn up; the next step runs.
    fail.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        pipe.step(x, y, loss_fn, schedule=schedule)
    assert turns.holder is None and not transport.waiting
    fail.armed = False
    pipe.step(x, y, loss_fn, schedule=schedule)


def test_the_turn_goes_to_a_worker_that_waits_for_it() -> None:
    """A worker waiting for a message only (its action is long) does not take the turn, so
    giving the turn up must not wake it in place of one that waits for the turn."""
    transport = transport_on([CPU, CPU, CPU])
    turns = Turns.of(transport)
    try:
        turns.take_turn(0, "forward")
        key = MessageKey("activations", 0, 1, 2)
        transport.send(key, outgoing([torch.ones(1)], atomic=True, detach=True))
        with transport.lock:  # partition 2's worker, about to wake for its message
            transport.waiting[2] = (key, False)

        worker = Worker(turn_taker(turns, 1))
        until(lambda: 1 in transport.waiting)
        turns.end_turn()
        worker.join()
        assert worker.error is None and worker.result == worker.thread.ident
    finally:
        transport.cancel()
        transport.finish(None)


def test_an_action_that_keeps_the_turn_too_long_loses_it(
    turns: Turns, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turns never make a worker wait without bound: a layer blocked until another
    partition's layer moves (test_core_dataflow) would otherwise wait for ever."""
    monkeypatch.setattr(_turns, "TAKE_OVER_AFTER", 0.01)
    me = threading.get_ident()
    turns.take_turn(0, "forward")  # and keeps it, as a blocked action would

    def second() -> int | None:
        turns.take_turn(1, "forward")
        return turns.holder

    worker = Worker(second)
    worker.join()
    assert worker.error is None and worker.result == worker.thread.ident != me
    turns.end_turn()  # not the holder any more: nothing to give up
    assert turns.holder == worker.thread.ident


class Where(nn.Module):
    """Notes the thread of each forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zbv"])
def test_a_step_of_short_actions_runs_in_the_calling_thread(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured short, every action runs in the caller's thread, waking no worker: the same
    gradients as the plain model; an error there leaves the model usable; once an action is
    long, the workers run again."""
    torch.manual_seed(0)
    where, fail = Where(), Fail()
    model = nn.Sequential(nn.Linear(4, 4), where, fail, nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    plain = nn.Sequential(*(layer for layer in model))
    placement = {"interleaved-1f1b": "loop", "zbv": "v"}.get(schedule)
    pipe = GPipe(
        model,
        [1, 2, 2, 1] if placement else [3, 3],
        chunks=4,
        checkpoint="never",
        placement=placement,
        devices=["cpu", "cpu"] if placement else None,
    )
    transport = pipe._placement.transport()
    assert isinstance(transport, LocalTransport)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss_fn = nn.MSELoss()
    pipe.step(x, y, loss_fn, schedule=schedule)  # measures every action, on the workers
    turns = Turns.of(transport)
    assert all(name.startswith("gpipe-worker") for name in where.threads)
    # Short, as they are alone (a first run's first-time costs can make one look long
    # until a probe measures it alone: test_long_actions_take_no_turn_except_to_be_measured).
    assert {j for j, _ in turns.slow} == set(range(len(pipe.partitions)))
    measured_short(pipe)
    where.threads.clear()
    pipe.zero_grad()
    pipe.step(x, y, loss_fn, schedule=schedule)
    assert where.threads == [threading.current_thread().name] * 4
    assert_plain_gradients(pipe, plain, x, y, loss_fn)
    fail.armed = True
    with pytest.raises(RuntimeError, match="boom") as raised:
        pipe.step(x, y, loss_fn, schedule=schedule)
    assert any("in forward of micro-batch 0" in note for note in raised.value.__notes__)
    assert turns.holder is None and not transport.messages and not transport.cancelled
    fail.armed = False
    # The partition of `where` computes for long now: the workers run the next steps.
    monkeypatch.setattr(_turns, "SHORT_ACTION", 0.0)
    where.threads.clear()
    for _ in range(LONG_AFTER + 1):
        pipe.step(x, y, loss_fn, schedule=schedule)
    assert all(name.startswith("gpipe-worker") for name in where.threads[-4:])
