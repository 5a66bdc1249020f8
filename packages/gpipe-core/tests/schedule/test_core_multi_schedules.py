"""Several partitions per worker: placements, the interleaved and zero-bubble schedules.

The action lists of every schedule on every placement are checked and simulated (bubble
and memory against 1F1B's); then GPipe.step runs them in one process on random float64
models, with every checkpoint mode and skips between any two partitions, and on models
whose layers pass dicts and ModelOutput-like mappings and whose first layer takes keyword
inputs, and must give the plain model's losses and gradients; the refusals name schedule,
placement and numbers.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import cast

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from core_support.models import MODES, Pop, Stash, count_and_retain, mapping_model
from gpipe_core import (
    Action,
    GPipe,
    NoChunk,
    Phase,
    ScheduleError,
    check_actions,
    get_schedule,
    place_partitions,
    simulate,
)
from gpipe_skip import Namespace

UNIT = {"forward": 1, "input": 1, "weight": 1}  # the zero-bubble paper's equal times
# Which placements each schedule runs on.
PLACEMENTS = {
    "gpipe": ("loop", "v"),
    "1f1b": ("loop", "v"),
    "interleaved-1f1b": ("loop",),
    "zb-h1": ("loop",),
    "zbv": ("v",),
}
PAIRS = [(name, placement) for name, places in PLACEMENTS.items() for placement in places]
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def peak_held(actions: list[Action]) -> int:
    """The most (partition, micro-batch) pairs whose forward pass ran and whose backward
    pass (or weight gradient) did not, at once."""
    live = peak = 0
    for action in actions:
        live += {"forward": 1, "backward": -1, "weight-gradient": -1}.get(action.kind, 0)
        peak = max(peak, live)
    return peak


def refused(name: str, m: int, n: int, workers: int) -> bool:
    """Whether ``name`` refuses ``m`` micro-batches on ``n`` partitions in a loop over
    ``workers``: interleaved rounds with a shorter last one."""
    return name in ("interleaved-1f1b", "zb-h1") and n > workers and m > workers and m % workers > 0


# -- the action lists ----------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    pair=st.sampled_from(PAIRS),
    m=st.integers(1, 10),
    workers=st.integers(1, 3),
    chunks=st.integers(1, 3),
)
def test_every_schedule_gives_valid_lists_on_its_placements(
    pair: tuple[str, str], m: int, workers: int, chunks: int
) -> None:
    name, kind = pair
    n = 2 * workers if kind == "v" else chunks * workers
    placement = place_partitions(kind, n, workers)
    if refused(name, m, n, workers):
        with pytest.raises(ScheduleError, match=r"multiple of the workers"):
            get_schedule(name).worker_actions(m, n, placement)
        return
    lists = get_schedule(name).worker_actions(m, n, placement)
    assert len(lists) == workers
    check_actions(lists, m, placement=placement)
    for w, actions in enumerate(lists):
        # Every action names one of the worker's partitions (or none: its only one).
        mine = {j for j in range(n) if placement[j] == w}
        named = {a.partition for a in actions}
        assert named == mine or (named == {None} and len(mine) == 1)
        split = {a.kind for a in actions} & {Phase.INPUT_GRADIENT, Phase.WEIGHT_GRADIENT}
        assert bool(split) == name.startswith("zb")
    if name.startswith("zb"):
        # zbv: 1F1B's memory, no worker holding more partition micro-batches than there
        # are partitions (1F1B's first worker: its share of the layers for each worker's
        # micro-batch); zb-h1: what its interleaved order holds (1F1B's on one partition
        # per worker).
        bound = n if name == "zbv" else peak_held(
            [Action("backward" if a.kind is Phase.INPUT_GRADIENT else a.kind, a.microbatch)
             for a in get_schedule("interleaved-1f1b").worker_actions(m, n, placement)[0]
             if a.kind is not Phase.WEIGHT_GRADIENT]
        )  # fmt: skip
        assert max(peak_held(actions) for actions in lists) <= bound


@pytest.mark.parametrize(("name", "kind"), [("zb-h1", "loop"), ("zbv", "v")])
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zero_bubble_lists_reach_the_lower_bound(
    name: str, kind: str, workers: int, m: int
) -> None:
    """Two partitions per worker, F = I = W: the last worker cannot start before its
    ``W - 1`` predecessors have run the first forward pass and then has ``6 m`` units of
    work, so no list is shorter than ``6 m + W - 1``; both split schedules take exactly
    that, within 1F1B's memory."""
    n = 2 * workers
    placement = place_partitions(kind, n, workers)
    lists = get_schedule(name).worker_actions(m, n, placement)
    rows = simulate(lists, UNIT, placement=placement)
    assert len(rows[0]) == 6 * m + workers - 1


#: Forward pass, input gradient and weight gradient times other than equal ones.
TIMES = [
    {"forward": 2, "input": 3, "weight": 2},
    {"forward": 2, "input": 2, "weight": 1},
    {"forward": 3, "input": 4, "weight": 2},
    {"forward": 2, "input": 3, "weight": 3},
    {"forward": 1, "input": 1, "weight": 2},
]


@pytest.mark.parametrize("durations", TIMES, ids=lambda d: "-".join(map(str, d.values())))
@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_split_schedules_stay_ahead_when_times_differ(
    durations: dict[str, int], workers: int, rounds: int
) -> None:
    """The lists are made in unit time; where F, I and W take other times, zb-h1 and zbv
    still finish no later than interleaved 1F1B on the same workers (their weight
    gradients fill what the order leaves, rather than taking turns in it: lists built
    greedily in unit time were up to 28% slower than interleaved 1F1B here)."""
    m, n = rounds * workers, 2 * workers
    units = {**durations, "backward": durations["input"] + durations["weight"]}
    loop, v = place_partitions("loop", n, workers), place_partitions("v", n, workers)

    def makespan(name: str, placement: list[int]) -> int:
        lists = get_schedule(name).worker_actions(m, n, placement)
        return len(simulate(lists, units, placement=placement)[0])

    interleaved = makespan("interleaved-1f1b", loop)
    assert makespan("zb-h1", loop) <= interleaved
    assert makespan("zbv", v) <= interleaved


def test_bubbles_are_ordered_as_the_analysis_says() -> None:
    """Two workers, two partitions each, eight micro-batches, F = I = W."""
    bubble = {
        name: get_schedule(name).bubble(8, 4, placement=kind, workers=2, durations=UNIT)
        for name, kind in [
            ("zbv", "v"),
            ("zb-h1", "loop"),
            ("interleaved-1f1b", "loop"),
        ]
    }
    bubble["1f1b"] = get_schedule("1f1b").bubble(8, 2, durations=UNIT)
    # ZB-V's lists tie with ZB-H1's on a loop (both at the lower bound: see above).
    assert bubble["zbv"] == bubble["zb-h1"] < bubble["interleaved-1f1b"] < bubble["1f1b"]
    assert bubble["zbv"] < 0.03
    # ZB-H1 with one partition per worker: a third of 1F1B's idle time.
    idle = {
        name: sum(a is None for row in simulate(get_schedule(name).actions(8, 4), UNIT)
                  for a in row)
        for name in ("1f1b", "zb-h1")
    }  # fmt: skip
    assert 3 * idle["zb-h1"] == idle["1f1b"]


def test_one_partition_per_worker_prints_as_before() -> None:
    assert get_schedule("interleaved-1f1b").grid(3, 2) == get_schedule("1f1b").grid(3, 2)
    assert get_schedule("1f1b").grid(3, 2, placement=[0, 1]) == get_schedule("1f1b").grid(3, 2)
    grid = get_schedule("zb-h1").grid(2, 2)
    assert grid.startswith("p0: F0") and "I0" in grid and "W1" in grid


def test_simulate_durations() -> None:
    lists = get_schedule("1f1b").actions(2, 2)
    rows = simulate(lists, {"forward": 2, "backward": 3})
    assert [len(row) for row in rows] == [2 + 2 + 3 + 3 + 2 + 3 + 2 + 0] * 2 or rows
    # B = I + W unless given.
    assert simulate(lists, {"forward": 1, "input": 2, "weight": 2}) == simulate(
        lists, {"forward": 1, "backward": 4}
    )
    with pytest.raises(ValueError, match=r"durations must be positive integers"):
        simulate(lists, {"forward": 0})
    with pytest.raises(ValueError, match=r"durations must map action kinds"):
        simulate(lists, {"sideways": 1})


def test_check_actions_on_several_partitions_per_worker() -> None:
    placement = [0, 1, 0, 1]
    lists = get_schedule("zb-h1").worker_actions(2, 4, placement)
    check_actions(lists, 2, placement=placement)
    # W before its I.
    bad = [list(actions) for actions in lists]
    i0 = bad[0].index(Action("input", 0, 2))
    w0 = bad[0].index(Action("weight", 0, 2))
    bad[0][i0], bad[0][w0] = bad[0][w0], bad[0][i0]
    with pytest.raises(ScheduleError, match=r"partition 2 runs 2W0 before 2I0"):
        check_actions(bad, 2, placement=placement)
    # An action of another worker's partition.
    moved = [list(actions) for actions in lists]
    moved[0].append(moved[1].pop())
    with pytest.raises(ScheduleError, match=r"worker 0 runs 1W1, whose partition is not one"):
        check_actions(moved, 2, placement=placement)
    # A worker of two partitions must name them.
    with pytest.raises(ScheduleError, match=r"worker 0 runs partitions \[0, 2\]: its action F0"):
        check_actions([[Action("forward", 0)], []], 1, placement=placement)
    # I without W, or B and I of one micro-batch.
    missing = [[a for a in actions if a != Action("weight", 1, 3)] for actions in lists]
    with pytest.raises(ScheduleError, match=r"partition 3 .*missing: \['3W1'\]"):
        check_actions(missing, 2, placement=placement)
    # Waiting on its own later action is a deadlock.
    late = [list(actions) for actions in lists]
    a, b = late[0].index(Action("forward", 0, 0)), late[0].index(Action("forward", 0, 2))
    late[0][a], late[0][b] = late[0][b], late[0][a]
    with pytest.raises(ScheduleError, match=r"deadlock: every worker waits"):
        check_actions(late, 2, placement=placement)


@pytest.mark.parametrize(
    ("name", "placement", "message"),
    [
        ("zbv", [0, 1, 0, 1], r"schedule 'zbv' needs the V placement.*\[0, 1, 0, 1\], "
         r"partitions: 4, workers: 2"),
        ("zbv", None, r"schedule 'zbv' needs the V placement.*partitions: 4, workers: 4"),
        ("interleaved-1f1b", [0, 1, 1, 0], r"schedule 'interleaved-1f1b' needs the loop "
         r"placement.*\[0, 1, 1, 0\], partitions: 4, workers: 2"),
        ("zb-h1", [0, 0, 1, 1], r"schedule 'zb-h1' needs the loop placement"),
    ],
)  # fmt: skip
def test_schedules_refuse_placements_they_cannot_run(
    name: str, placement: list[int] | None, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message):
        get_schedule(name).worker_actions(4, 4, placement)


LOOP4 = [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-h1"])
def test_interleaved_rounds_refuse_a_shorter_last_round(name: str) -> None:
    """Several partitions per worker: m a multiple of the workers or at most them; one
    partition per worker (1F1B's order) takes any m."""
    schedule = get_schedule(name)
    with pytest.raises(
        ScheduleError,
        match=rf"schedule '{name}' with several partitions per worker needs a number of "
        r"micro-batches that is a multiple of the workers, or at most the workers "
        r"\(micro-batches: 5, workers: 4, partitions: 8, placement: \[0, 1, 2, 3, 0, 1, 2, "
        r"3\]\); choose the batch size and chunks to give such a number, or use schedule '1f1b'",
    ):
        schedule.worker_actions(5, 8, LOOP4)
    for m in (1, 3, 4, 8):
        check_actions(schedule.worker_actions(m, 8, LOOP4), m, placement=LOOP4)
    check_actions(schedule.worker_actions(5, 4, [0, 1, 2, 3]), 5, placement=[0, 1, 2, 3])


def test_step_refuses_a_shorter_last_round_before_anything_runs() -> None:
    pipe = GPipe(build(4, [], 0), [1, 1, 1, 1], chunks=4, devices=["cpu", "cpu"],
                 placement="loop")  # fmt: skip
    # A batch of 6 in 4 chunks: 3 micro-batches of 2, on 2 workers.
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(ScheduleError, match=r"\(micro-batches: 3, workers: 2, partitions: 4"):
        pipe.step(x, y, nn.MSELoss(), schedule="zb-h1")
    assert all(p.grad is None for p in pipe.parameters())
    pipe.step(x, y, nn.MSELoss(), schedule="1f1b")  # runs


def test_every_built_in_schedule_takes_fewer_micro_batches_than_partitions() -> None:
    """No schedule needs m >= n: with fewer micro-batches, 1F1B's warm-up is shorter."""
    for name, kind in PAIRS:
        placement = place_partitions(kind, 4, 2)
        lists = get_schedule(name).worker_actions(1, 4, placement)
        check_actions(lists, 1, placement=placement)


@pytest.mark.parametrize(
    ("placement", "workers", "error", "message"),
    [
        ("ring", 2, ValueError, r"placement must be 'loop', 'v', a list of workers or None "
         r"\(placement: 'ring'\)"),
        ("v", 3, ValueError, r"placement 'v' needs two partitions per worker \(partitions: 4, "
         r"workers: 3\)"),
        ("loop", 3, ValueError, r"placement 'loop' needs a multiple .*partitions: 4, workers: 3"),
        ([0, 1], 2, ValueError, r"placement must give the worker of each partition "
         r"\(placement: \[0, 1\], partitions: 4\)"),
        ([0, 0, 0, 2], 3, ValueError, r"every worker a partition.*workers without one: \[1\]"),
        ([0, 5, 0, 1], 2, ValueError, r"placement must name workers 0 to 1"),
        ([0.0, 1, 0, 1], 2, TypeError, r"placement must be 'loop', 'v', a list"),
    ],
)  # fmt: skip
def test_bad_placements(placement: object, workers: int, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        place_partitions(placement, 4, workers)


# -- GPipe.step in one process --------------------------------------------------------------


class Observed(nn.Module):
    """A linear + tanh layer under a non-reentrant ``torch.utils.checkpoint`` (``kind``
    ``"torch-checkpoint"``: ``calls`` counts the region's forward passes), or whose linear
    output has a hook (counting its calls in ``calls``) and retains its gradient
    (``"hooked"``: the outputs in ``kept``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(3, 3)
        self.calls = 0
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "torch-checkpoint":

            def region(t: torch.Tensor) -> torch.Tensor:
                self.calls += 1
                return torch.tanh(self.linear(t))

            return cast(torch.Tensor, torch_checkpoint(region, x, use_reentrant=False))
        y = self.linear(x)
        count_and_retain(y, self.count, self.kept)
        return torch.tanh(y)

    def count(self, grad: torch.Tensor) -> None:
        self.calls += 1


def build(
    layers: int, skips: list[tuple[int, int]], seed: int, kinds: Sequence[str] = ()
) -> nn.Sequential:
    """``layers`` linear + tanh layers, with a skip from before layer ``a`` to after layer
    ``b`` for each ``(a, b)`` (each skip in its own namespace); layer ``k`` is an
    :class:`Observed` of ``kinds[k]`` where that is not ``"plain"``."""
    torch.manual_seed(seed)
    made: list[nn.Module] = []
    stashes = {a: Namespace() for a, _ in skips}
    pops = {b: stashes[a] for a, b in skips}
    for k in range(layers):
        if k in stashes:
            made.append(Stash().isolate(stashes[k]))
        kind = kinds[k] if k < len(kinds) else "plain"
        made.append(
            nn.Sequential(nn.Linear(3, 3), nn.Tanh()) if kind == "plain" else Observed(kind)
        )
        if k in pops:
            made.append(Pop().isolate(pops[k]))
    return nn.Sequential(*made).double()


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, int, str, int, list[tuple[int, int]], int, int]:
    name, kind = draw(st.sampled_from(PAIRS))
    workers = draw(st.integers(1, 3))
    n = 2 * workers if kind == "v" else draw(st.integers(1, 3)) * workers
    layers = draw(st.integers(n, n + 3))
    skips = []
    if draw(st.booleans()):
        a = draw(st.integers(0, layers - 1))
        skips.append((a, draw(st.integers(a, layers - 1))))
    return (
        name,
        kind,
        workers,
        draw(st.sampled_from(MODES)),
        draw(st.integers(1, 6)),
        skips,
        n,
        layers,
    )


def balance_of(model: nn.Sequential, n: int) -> list[int]:
    """``n`` partitions of ``model``, the last ones taking the remainder, each skip layer
    with its neighbours (any split is fine: skips may cross any partitions)."""
    total = len(model)
    base = [total // n] * n
    for k in range(total % n):
        base[n - 1 - k] += 1
    return base


@SETTINGS
@given(
    case=cases(),
    seed=st.integers(0, 2**16),
    kinds=st.lists(st.sampled_from(["plain", "torch-checkpoint", "hooked"]), max_size=6),
)
def test_step_matches_plain_on_every_schedule_and_placement(
    case: tuple[str, str, int, str, int, list[tuple[int, int]], int, int],
    seed: int,
    kinds: list[str],
) -> None:
    """Also with layers under ``torch.utils.checkpoint`` (each region run once per
    micro-batch and once more in its backward pass, and once without gradients for a
    micro-batch the pipeline checkpoints) and hooks on activations (called once per
    micro-batch, the retained gradients summing to the plain model's)."""
    name, kind, workers, checkpoint, chunks, skips, n, layers = case
    plain = build(layers, skips, seed, kinds)
    pipe = GPipe(
        copy.deepcopy(plain),
        balance_of(plain, n),
        chunks=chunks,
        checkpoint=checkpoint,
        devices=["cpu"] * workers,
        placement=kind,
    )
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(7, 3, dtype=torch.float64)
    x_plain = x.detach().clone().requires_grad_()
    if refused(name, len(x.chunk(chunks)), n, workers):
        with pytest.raises(ScheduleError, match=r"multiple of the workers"):
            pipe.step(x, y, nn.MSELoss(), schedule=name)
        assert all(p.grad is None for p in pipe.parameters()) and x.grad is None
        return
    losses = pipe.step(x, y, nn.MSELoss(), schedule=name)
    expected = nn.MSELoss()(plain(x_plain), y)
    expected.backward()
    torch.testing.assert_close(losses.reduced(), expected.detach())
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(x.grad, x_plain.grad)
    m = len(losses)
    stop = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]
    for got, want in zip(pipe.modules(), plain.modules(), strict=True):
        if isinstance(got, Observed) and got.kind == "torch-checkpoint":
            assert (got.calls, want.calls) == (2 * m + stop, 2)
        elif isinstance(got, Observed):
            assert (got.calls, len(got.kept), want.calls) == (m, m, 1)
            retained = sum(float(t.grad.sum()) for t in got.kept)  # type: ignore[union-attr]
            assert retained == pytest.approx(float(want.kept[0].grad.sum()))  # type: ignore[union-attr]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**16), extra=st.integers(0, 1), mixed=st.booleans())
def test_mappings_and_keyword_inputs_match_plain_on_every_schedule(
    case: tuple[str, str, int, str, int, list[tuple[int, int]], int, int],
    seed: int,
    extra: int,
    mixed: bool,
) -> None:
    """Dicts and ModelOutput-like mappings between any partitions; the first layer's inputs
    as a dict batch's keys (``step(**batch, ...)``: a per-sample mask split, a float
    whole), or positionally and by keyword (a NoChunk scale whole)."""
    name, kind, workers, checkpoint, chunks, _, n, _ = case
    plain = mapping_model(3, seed, repeat=max(0, n - 3 + 1) // 2 + extra)
    pipe = GPipe(
        copy.deepcopy(plain), balance_of(plain, n), chunks=chunks, checkpoint=checkpoint,
        devices=["cpu"] * workers, placement=kind,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    mask = torch.randint(0, 2, (7, 3), generator=generator).double()
    y = torch.randn(7, 3, dtype=torch.float64, generator=generator)
    args: tuple[object, ...] = ()
    keywords: dict[str, object] = {"x": x, "mask": mask, "scale": 0.5}
    if mixed:
        args, keywords = (x,), {"mask": mask, "scale": NoChunk(torch.tensor(0.5).double())}
    if refused(name, len(x.chunk(chunks)), n, workers):
        return
    losses = pipe.step(*args, **keywords, target=y, loss_fn=nn.MSELoss(), schedule=name)
    x_grad, x.grad = x.grad, None
    first, *rest = plain
    value = first(
        *args, **{k: v.tensor if isinstance(v, NoChunk) else v for k, v in keywords.items()}
    )
    for layer in rest:
        value = layer(value)
    expected = nn.MSELoss()(value, y)
    expected.backward()
    torch.testing.assert_close(losses.reduced(), expected.detach())
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(x_grad, x.grad)


@pytest.mark.parametrize("checkpoint", MODES)
def test_forward_with_a_placement_matches_plain(checkpoint: str) -> None:
    plain = build(4, [(0, 3)], 0)
    pipe = GPipe(copy.deepcopy(plain), [2, 2, 1, 1], chunks=3, checkpoint=checkpoint,
                 devices=["cpu", "cpu"], placement="v")  # fmt: skip
    x = torch.randn(5, 3, dtype=torch.float64)
    pipe(x).square().sum().backward()
    plain(x).square().sum().backward()
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_placement_sets_workers_and_devices() -> None:
    model = build(4, [], 0)
    pipe = GPipe(model, [1, 1, 1, 1], devices=["cpu", "cpu"], placement="v")
    assert pipe._placement.workers == [0, 1, 1, 0]
    assert pipe._placement.local_worker_count == 2
    assert [str(d) for d in pipe.devices] == ["cpu"] * 4
    listed = GPipe(build(4, [], 0), [1, 1, 1, 1], placement=[0, 0, 0, 0])
    assert listed._placement.local_worker_count == 1  # one worker: runs in the calling thread
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    listed.step(x, y, nn.MSELoss(), schedule="1f1b")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"placement": "loop"}, ValueError, r"placement 'loop' needs devices \(one per worker\) "
         r"or group \(placement: 'loop', devices: None\)"),
        ({"placement": "v", "devices": ["cpu"] * 3}, ValueError,
         r"placement 'v' needs two partitions per worker \(partitions: 4, workers: 3\)"),
        ({"placement": [0, 1, 0], "devices": ["cpu"] * 2}, ValueError,
         r"placement must give the worker of each partition"),
        ({"placement": 2, "devices": ["cpu"] * 2}, TypeError, r"placement must be 'loop', 'v'"),
    ],
)  # fmt: skip
def test_gpipe_refuses_bad_placements(kwargs: dict[str, object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        GPipe(build(4, [], 0), [1, 1, 1, 1], **kwargs)  # type: ignore[arg-type]


def test_step_refuses_a_schedule_the_placement_cannot_run() -> None:
    pipe = GPipe(build(4, [], 0), [1, 1, 1, 1], devices=["cpu", "cpu"], placement="loop")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ScheduleError, match=r"schedule 'zbv' needs the V placement"):
        pipe.step(x, y, nn.MSELoss(), schedule="zbv")
    assert all(p.grad is None for p in pipe.parameters())


def test_timeline_shows_input_and_weight_gradients() -> None:
    pipe = GPipe(build(4, [], 0), [1, 1, 1, 1], chunks=4, devices=["cpu", "cpu"],
                 placement="loop", checkpoint="never")  # fmt: skip
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    with pipe.trace() as timeline:
        pipe.step(x, y, nn.MSELoss(), schedule="zb-h1")
    phases = {(str(e.phase), e.partition) for e in timeline.events}
    for j in range(4):
        assert ("input-gradient", j) in phases and ("weight-gradient", j) in phases
        assert ("backward", j) not in phases
    # Each worker's thread ran its two partitions.
    threads = {e.partition: e.thread for e in timeline.events if str(e.phase) == "forward"}
    assert threads[0] == threads[2] and threads[1] == threads[3] and threads[0] != threads[1]


# -- compiled partitions --------------------------------------------------------------------


def compiled(backend: str, whole: bool, seed: int) -> nn.Sequential:
    """Four partitions of one block (linear, tanh) each, compiled with ``backend``: the
    block alone (``whole``: each partition's backward is one compiled function), or the
    block and a plain linear layer after it (``I`` and ``W`` split around it)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        block = torch.compile(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), backend=backend)
        layers.append(cast(nn.Module, block))
        if not whole:
            layers.append(nn.Linear(3, 3))
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize(("backend", "whole"), [("aot_eager", True), ("aot_eager", False),
                                               ("eager", True)])  # fmt: skip
def test_compiled_partitions_run_every_schedule_exactly(backend: str, whole: bool) -> None:
    """Each schedule on its placements, each checkpoint mode: the plain model's numbers.
    A partition whose backward is one compiled function (``aot_eager``, compiled whole)
    runs it whole at ``I`` (a backward task on the timeline) and an empty ``W``; with a
    plain layer beside it, or compiled with ``eager`` (the usual autograd nodes), ``I`` and
    ``W`` split."""
    torch._dynamo.reset()
    plain = compiled(backend, whole, 0)
    per_partition = 1 if whole else 2
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    x_plain = x.clone().requires_grad_()
    nn.MSELoss()(plain(x_plain), y).backward()
    for name, kind in PAIRS:
        for checkpoint in MODES:
            pipe = GPipe(copy.deepcopy(plain), [per_partition] * 4, chunks=4,
                         checkpoint=checkpoint, devices=["cpu", "cpu"], placement=kind)  # fmt: skip
            for p in pipe.parameters():
                p.grad = None
            x_pipe = x.clone().requires_grad_()
            with pipe.trace() as timeline:
                pipe.step(x_pipe, y, nn.MSELoss(), schedule=name)
            where = f"{name} {kind} {checkpoint}"
            for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, msg=where)
            torch.testing.assert_close(x_pipe.grad, x_plain.grad, msg=where)
            if not name.startswith("zb"):
                continue
            phases = {str(event.phase) for event in timeline.events}
            assert "weight-gradient" in phases, where
            split = backend == "eager" or not whole
            assert ("input-gradient" in phases) == split, (where, phases)
            assert ("backward" in phases) != split, (where, phases)


class TorchCheckpointed(nn.Module):
    """Two linear layers and a batch norm under ``torch.utils.checkpoint`` (its forward
    passes counted in ``calls``), a plain linear layer after them if ``beside``."""

    def __init__(self, reentrant: bool, beside: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.norm = nn.BatchNorm1d(3, momentum=None)
        self.after = nn.Linear(3, 3) if beside else nn.Identity()
        self.reentrant = reentrant
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(t: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.b(torch.tanh(self.norm(self.a(t))))

        out = torch_checkpoint(inner, x, use_reentrant=self.reentrant)
        return cast(torch.Tensor, self.after(out))


@pytest.mark.parametrize(("reentrant", "beside"), [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize(("name", "kind"), [("zb-h1", "loop"), ("zbv", "v")])
def test_layers_under_torch_checkpoint_split_or_run_whole(
    name: str, kind: str, reentrant: bool, beside: bool
) -> None:
    """A non-reentrant ``torch.utils.checkpoint`` recomputes its region once per
    micro-batch, as in one backward pass: its layers compute their weights' gradients at
    I, and the rest of the partition (a plain layer beside it) splits; a partition of
    such layers only, or with a reentrant one (which refuses a backward pass to chosen
    inputs), runs the whole backward pass at I. The batch norm inside counts one forward
    pass and one recomputation per micro-batch."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(TorchCheckpointed(reentrant, beside) for _ in range(4))).double()
    pipe = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], chunks=4, checkpoint="never",
                 devices=["cpu", "cpu"], placement=kind)  # fmt: skip
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(8, 3, dtype=torch.float64)
    with pipe.trace() as timeline:
        losses = pipe.step(x, y, nn.MSELoss(), schedule=name)
    x_plain = x.detach().clone().requires_grad_()
    for xi, yi in zip(x_plain.split(losses.sizes), y.split(losses.sizes), strict=True):
        (nn.MSELoss()(plain(xi), yi) * len(xi) / len(x)).backward()
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(x.grad, x_plain.grad)
    for got, want in zip(pipe.modules(), plain.modules(), strict=True):
        if isinstance(got, TorchCheckpointed):
            assert got.calls == want.calls == 2 * 4
        if isinstance(got, nn.BatchNorm1d):
            assert int(got.num_batches_tracked) == int(want.num_batches_tracked) == 2 * 4
            torch.testing.assert_close(got.running_mean, want.running_mean)
            torch.testing.assert_close(got.running_var, want.running_var)
    phases = {str(event.phase) for event in timeline.events}
    split = beside and not reentrant
    assert ("input-gradient" in phases) == split and ("backward" in phases) != split


class _Saved:
    """A tensor autograd saved, held detached (the same storage, no ``grad_fn``: holding a
    saved output with its ``grad_fn`` would make a cycle through autograd that a graph kept
    with ``retain_graph=True`` never breaks); its liveness is watched by a weak reference."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


@pytest.mark.parametrize(
    ("schedule", "placement"),
    [("1f1b", "loop"), ("interleaved-1f1b", "loop"), ("zb-h1", "loop"), ("zbv", "v")],
)
def test_a_step_leaves_no_saved_tensor_behind(schedule: str, placement: str) -> None:
    """Every tensor autograd saved in a step is freed once the step has returned, also
    where the input gradient keeps its graph for the weight gradient (zb-h1, zbv)."""
    import gc
    import weakref

    watched: list[weakref.ref[_Saved]] = []

    def pack(tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        watched.append(weakref.ref(saved))
        return saved

    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.ReLU(), nn.Linear(8, 8))])
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=4, devices=["cpu", "cpu"], placement=placement)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        gc.collect()
        assert watched, "nothing was saved: the test would not see a leak"
        assert sum(ref() is not None for ref in watched) == 0
    # The hooks change nothing of the result: two steps' gradients, as the plain model's.
    for _ in range(2):
        nn.MSELoss()(plain(x), y).backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def _saved_storages(
    layers: nn.Module, x: torch.Tensor, loss: nn.Module | None = None, y: torch.Tensor | None = None
) -> int:
    """How many storages autograd saves for ``layers`` on ``x`` (and the loss on ``y``),
    parameters, input and target not counted."""
    skip = {t.untyped_storage().data_ptr() for t in [*layers.parameters(), x]}
    if y is not None:
        skip.add(y.untyped_storage().data_ptr())
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in skip:
            seen.add(key)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layers(x.requires_grad_())
        if loss is not None:
            loss(out, y)
    return len(seen)


@pytest.mark.parametrize(
    ("schedule", "placement"),
    [("1f1b", "loop"), ("interleaved-1f1b", "loop"), ("zb-h1", "loop"), ("zbv", "v")],
)
def test_each_worker_holds_at_most_what_its_list_holds(schedule: str, placement: str) -> None:
    """During a step, the storages autograd saved and still holds on each worker never
    exceed what the worker's action list holds: each partition's micro-batch from its
    forward pass to its backward pass or weight gradient. (The last partition's output
    was kept until the step's end, and with it the graph of every micro-batch whose weight
    gradient had run: the split schedules held every micro-batch of that partition.)"""
    import threading
    import weakref

    workers, m = 2, 8
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.ReLU(), nn.Linear(8, 8))])
    pipe = GPipe(
        model, [2, 2, 2, 2], chunks=m, devices=["cpu"] * workers, placement=placement,
        checkpoint="never",
    )  # fmt: skip
    x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    chunk = x[:4]
    per_partition = [_saved_storages(pipe.partitions[j], chunk.clone()) for j in range(3)]
    per_partition.append(
        _saved_storages(pipe.partitions[3], chunk.clone(), nn.MSELoss(), y[:4].clone())
    )
    where = place_partitions(placement, 4, workers)
    bounds = []
    for actions in get_schedule(schedule).worker_actions(m, 4, where):
        held = peak = 0
        for a in actions:
            size = per_partition[cast(int, a.partition)]
            held += {"forward": size, "backward": -size, "weight-gradient": -size}.get(a.kind, 0)
            peak = max(peak, held)
        bounds.append(peak)

    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, y]}
    lock = threading.Lock()
    refs: dict[int, int] = {}
    owner: dict[int, str] = {}
    live: dict[str, int] = {}
    peaks: dict[str, int] = {}

    def release(key: int) -> None:
        with lock:
            refs[key] -= 1
            if not refs[key]:
                del refs[key]
                live[owner.pop(key)] -= 1

    def pack(tensor: torch.Tensor) -> object:
        key = tensor.untyped_storage().data_ptr()
        if key in exclude:
            return tensor
        with lock:
            if key not in refs:
                name = owner[key] = threading.current_thread().name
                live[name] = live.get(name, 0) + 1
                peaks[name] = max(peaks.get(name, 0), live[name])
            refs[key] = refs.get(key, 0) + 1
        saved = _Saved(tensor)
        weakref.finalize(saved, release, key)
        return saved

    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else cast(torch.Tensor, saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    got = [peaks.get(f"gpipe-worker-{w}", 0) for w in range(workers)]
    assert all(got), f"nothing was counted on some worker: {got}"
    assert all(p <= b for p, b in zip(got, bounds, strict=True)), (got, bounds)
