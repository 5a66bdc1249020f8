"""Where skip tensors go inside GPipe, how long they live, and what errors leave behind.

A long skip over four partitions must be sent once per micro-batch from the first
partition straight to the last: never to the partitions in between, and never copied at
all when the partitions share a device. Skip tensors are freed once their gradient has
flowed, 200 training steps leave no tensor behind, and after an error in forward, in
backward or in a recomputation the model trains normally.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import gpipe_core.run._partition_run as core_partition_run
from core_support.checks import assert_matches_plain
from core_support.models import MODES
from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe
from gpipe_core.transport._transport import LocalTransport, Message, MessageKey
from gpipe_skip import current_skip_tracker, pop, skippable, stash

WIDTH, SKIP_WIDTH = 3, 7


@skippable(stash=["long"])
class LongStash(nn.Module):
    """Stashes a projection of width 7, so that it cannot pass for the width-3 main path."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(WIDTH, SKIP_WIDTH)
        self.stashed: list[torch.Tensor] = []
        self.keep = False

    def forward(self, x):
        skip = self.project(x)
        if self.keep:
            self.stashed.append(skip)
        yield stash("long", skip)
        return x * 2


@skippable(pop=["long"])
class LongPop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.back = nn.Linear(SKIP_WIDTH, WIDTH)
        self.popped: list[torch.Tensor] = []
        self.keep = False
        self.fail = False

    def forward(self, x):
        skip = yield pop("long")
        if self.keep:
            self.popped.append(skip)
        if self.fail:
            raise ValueError("a layer failed after its pop")
        return x + self.back(skip)


class Probe(nn.Module):
    """Records the shapes of every tensor its partition receives."""

    def __init__(self, seen: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x):
        tensors = x if isinstance(x, tuple) else (x,)
        self.seen.extend(tuple(t.shape) for t in tensors)
        return x


def long_skip_model(seen: list[list[tuple[int, ...]]] | None = None) -> nn.Sequential:
    """Eight layers for balance [2, 2, 2, 2]: the skip goes from partition 0 to partition 3."""
    torch.manual_seed(0)
    probes = [Probe(seen[j] if seen else []) for j in range(3)]
    return nn.Sequential(
        LongStash(),
        nn.Linear(WIDTH, WIDTH),
        probes[0],  # partition 1
        nn.Linear(WIDTH, WIDTH),
        probes[1],  # partition 2
        nn.Tanh(),
        probes[2],  # partition 3
        LongPop(),
    ).double()


def count_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[str, int, int, list[tuple[int, ...]]]]:
    """Every message the in-process transport sends: (contents, source, target, shapes)."""
    sends: list[tuple[str, int, int, list[tuple[int, ...]]]] = []
    real_send = LocalTransport.send

    def counting_send(self: LocalTransport, key: MessageKey, message: Message) -> None:
        shapes = [tuple(t.shape) for t in message.tensors]
        sends.append((key.contents, key.source, key.target, shapes))
        real_send(self, key, message)

    monkeypatch.setattr(LocalTransport, "send", counting_send)
    return sends


@pytest.mark.parametrize("path", ["forward", "step"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_long_skip_is_sent_straight_to_the_last_partition(
    checkpoint: str,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends = count_sends(monkeypatch)
    seen: list[list[tuple[int, ...]]] = [[], [], []]
    model = long_skip_model(seen)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=3, checkpoint=checkpoint)
    assert [(r.stash_partition, r.pop_partition) for r in pipe.skip_layout.routes] == [(0, 3)]

    for probe in seen:
        probe.clear()
    x = torch.randn(7, WIDTH, dtype=torch.float64)
    if path == "forward":
        assert_matches_plain(pipe, plain, x, weighted=True)
    else:
        target = torch.randn(7, WIDTH, dtype=torch.float64)
        pipe.step(x, target, nn.MSELoss())
        nn.MSELoss()(plain(x), target).backward()
        for mine, theirs in zip(pipe.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad)

    # Micro-batches of 3, 3 and 1 samples: one send each, from partition 0 to partition 3.
    skips = [(source, target, shapes) for kind, source, target, shapes in sends if kind == "skips"]
    assert skips == [
        (0, 3, [(3, SKIP_WIDTH)]),
        (0, 3, [(3, SKIP_WIDTH)]),
        (0, 3, [(1, SKIP_WIDTH)]),
    ]
    # A step sends each skip's gradient straight back, once per micro-batch.
    grads = sorted(
        (source, target, shapes)
        for kind, source, target, shapes in sends
        if kind == "skip-gradients"
    )
    if path == "step":
        assert grads == sorted([(3, 0, [(3, SKIP_WIDTH)])] * 2 + [(3, 0, [(1, SKIP_WIDTH)])])
    else:
        assert grads == []  # autograd carries them
    # The partitions in between (and the last one's main input) see only the main path,
    # in forward and in every recomputation.
    for shapes in seen:
        assert shapes
        assert all(shape[1:] == (WIDTH,) for shape in shapes), shapes
    runs = 3 + {"always": 3, "except_last": 2, "never": 0}[checkpoint]
    assert [len(shapes) for shapes in seen] == [runs, runs, runs]


@pytest.mark.parametrize("checkpoint", MODES)
def test_one_device_means_no_copy_at_all(checkpoint: str) -> None:
    model = long_skip_model()
    model[0].keep = model[7].keep = True
    pipe = GPipe(model, [2, 2, 2, 2], chunks=2, checkpoint=checkpoint)
    pipe(torch.randn(4, WIDTH, dtype=torch.float64)).sum().backward()
    stashed, popped = pipe[0].stashed, pipe[7].popped
    # Two pops per checkpointed micro-batch (forward and recomputation); the first
    # partition's recomputation stashes afresh for its own backward.
    assert len(popped) == 2 + {"always": 2, "except_last": 1, "never": 0}[checkpoint]
    # Every popped tensor is a stashed one itself, not a copy; but with several
    # micro-batches the first one of a partition gets a private copy of its whole input, to
    # see whether the partition modifies it in place (see PartitionTraits).
    probe = 1
    assert {t.data_ptr() for t in popped[probe:]} <= {t.data_ptr() for t in stashed}
    assert all(t.data_ptr() not in {s.data_ptr() for s in stashed} for t in popped[:probe])


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_tensors_are_freed_once_their_gradient_has_flowed(checkpoint: str) -> None:
    model = long_skip_model()
    model[7].keep = True
    pipe = GPipe(model, [2, 2, 2, 2], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    out = pipe(x)
    refs = [weakref.ref(t) for t in pipe[7].popped]
    pipe[7].popped.clear()
    pipe[7].keep = False
    # Alive until backward (but the private copy of the probe, see above).
    probe = 0 if checkpoint == "never" else 1
    assert len(refs) == 4 and all(ref() is not None for ref in refs[probe:])
    out.sum().backward()
    del out
    assert all(ref() is None for ref in refs)
    assert len(current_skip_tracker()) == 0


def count_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_no_memory_growth_over_200_steps(checkpoint: str) -> None:
    model = long_skip_model()
    pipe = GPipe(model, [2, 2, 2, 2], chunks=4, checkpoint=checkpoint)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    x = torch.randn(8, WIDTH, dtype=torch.float64)

    def step() -> None:
        optimizer.zero_grad()
        pipe(x).square().mean().backward()
        optimizer.step()

    for _ in range(5):
        step()
    tensors, threads = count_tensors(), threading.active_count()
    for _ in range(200):
        step()
    assert count_tensors() <= tensors
    assert threading.active_count() == threads


class BackwardFailure(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if BackwardFailure.armed:
            raise ArithmeticError("backward of a skip failed")
        return grad


@skippable(pop=["long"])
class FragilePop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.back = nn.Linear(SKIP_WIDTH, WIDTH)
        self.flip_in_recompute = False

    def forward(self, x):
        skip = yield pop("long")
        return x + self.back(BackwardFailure.apply(skip))


@skippable(stash=["long"])
class FlakyStash(nn.Module):
    """Stashes None in the recomputation when told to: a conditional that changed."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(WIDTH, SKIP_WIDTH)
        self.flaky = False

    def forward(self, x):
        skip = self.project(x)
        yield stash("long", None if self.flaky and is_recomputing() else skip)
        return x * 2


@skippable(pop=["long"])
class TolerantPop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.back = nn.Linear(SKIP_WIDTH, WIDTH)

    def forward(self, x):
        skip = yield pop("long")
        return x if skip is None else x + self.back(skip)


@pytest.mark.parametrize("checkpoint", MODES)
def test_errors_leave_the_model_usable(checkpoint: str) -> None:
    model = long_skip_model()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, WIDTH, dtype=torch.float64)

    pipe[7].fail = True
    with pytest.raises(ValueError, match="a layer failed after its pop"):
        pipe(x)
    pipe[7].fail = False
    assert_matches_plain(pipe, plain, x, weighted=True)
    assert len(current_skip_tracker()) == 0


@pytest.mark.parametrize("checkpoint", MODES)
def test_backward_error_leaves_the_model_usable(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LongStash(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), FragilePop()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, WIDTH, dtype=torch.float64)
    BackwardFailure.armed = True
    try:
        with pytest.raises(ArithmeticError, match="backward of a skip failed"):
            pipe(x).sum().backward()
    finally:
        BackwardFailure.armed = False
    assert_matches_plain(pipe, plain, x, weighted=True)


def test_a_conditional_skip_that_changes_in_recomputation_is_a_clear_error() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FlakyStash(), nn.Linear(WIDTH, WIDTH), TolerantPop()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    pipe[0].flaky = True
    with pytest.raises(
        RuntimeError,
        match=r"the recomputation of output of partition 0 differs from its first run: .* "
        r"\(first run stashed: \['long'\], recomputation stashed: \[\]\)",
    ):
        pipe(x).sum().backward()
    pipe[0].flaky = False
    assert_matches_plain(pipe, plain, x, weighted=True)


def test_an_undeclared_name_in_a_partition_is_reported_and_the_model_recovers() -> None:
    @skippable(pop=["long"])
    class Sloppy(nn.Module):
        sloppy = True

        def forward(self, x):
            skip = yield pop("other" if self.sloppy else "long")
            return x + skip.sum()

    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(LongStash(), nn.ReLU(), Sloppy()).double(), [1, 1, 1], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"yielded pop\('other'\) but Sloppy does not declare"):
        pipe(x)
    pipe[2].sloppy = False
    pipe(x).sum().backward()


def test_gpipe_verifies_skips_when_it_wraps_a_module() -> None:
    model = nn.Sequential(LongPop(), nn.ReLU(), LongStash())
    with pytest.raises(
        TypeError,
        match=r"inconsistent \(1 problem\):\n  - layer 0 \(LongPop\) pops 'long' in "
        r"<default namespace> before layer 2 stashes it",
    ):
        GPipe(model, [1, 2])


def test_models_without_skippables_take_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refused:
        def __init__(self, *args: Any) -> None:
            raise AssertionError("a model without skippable layers set up skip handling")

    monkeypatch.setattr(core_partition_run, "SkipCall", Refused)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2], chunks=2)
    assert pipe.skip_layout.empty
    assert_matches_plain(pipe, plain, torch.randn(4, 3, dtype=torch.float64))
    # The control: a model with skips does ask for it.
    with pytest.raises(AssertionError, match="set up skip handling"):
        GPipe(long_skip_model(), [2, 2, 2, 2])(torch.randn(2, WIDTH, dtype=torch.float64))


def test_deepcopy_and_pickle_keep_skips_working() -> None:
    import pickle

    model = long_skip_model()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=2)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    for clone in (copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe))):
        assert [r.pop_partition for r in clone.skip_layout.crossing()] == [3]
        assert_matches_plain(clone, plain, x)


@pytest.mark.parametrize("path", ["forward", "step"])
def test_a_conditional_skip_inside_one_partition_that_changes_is_a_clear_error(path: str) -> None:
    # Stash and pop in the same partition: the skip never leaves it, but a recomputation
    # that stashes otherwise recomputes another function, whose gradient would be wrong.
    torch.manual_seed(0)
    model = nn.Sequential(FlakyStash(), nn.Linear(WIDTH, WIDTH), TolerantPop(), nn.Tanh()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [3, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y = torch.randn(4, WIDTH, dtype=torch.float64)
    pipe[0].flaky = True
    with pytest.raises(
        RuntimeError,
        match=r"the recomputation of output of partition 0 differs from its first run: .* "
        r"\(first run stashed: \['long'\], recomputation stashed: \[\]\)",
    ):
        if path == "forward":
            pipe(x).sum().backward()
        else:
            pipe.step(x, y, nn.MSELoss())
    pipe[0].flaky = False
    pipe.zero_grad()
    assert_matches_plain(pipe, plain, x, weighted=True)
