"""Several partitions per rank across processes: every schedule on its placements.

Four partitions on two ranks (``placement="loop"``: partitions 0, 2 | 1, 3; ``"v"``:
0, 3 | 1, 2), each schedule on each placement it runs, every checkpoint mode, with a skip
between partitions on one rank and one between ranks, a tuple with an integer tensor
between partitions, dicts and ModelOutput-like mappings between partitions with keyword
inputs, an uneven last micro-batch and a batch size that changes between steps: the plain
model's losses, gradients and input gradients. Messages between
partitions of one rank never reach the transport; ranks that disagree on the placement
or the schedule raise the same error. The hypothesis equivalence over random models is
in one process (``test_core_multi_schedules.py``); here a fixed set of combinations runs
on one pair of ranks (``cluster2``, started once for the module).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_support.distributed_checks import check_alike, check_steps, same_value_error
from core_support.models import MODES
from core_support.strategies import compositions

PAIRS = [
    ("gpipe", "loop"),
    ("1f1b", "loop"),
    ("interleaved-1f1b", "loop"),
    ("zb-h1", "loop"),
    ("gpipe", "v"),
    ("1f1b", "v"),
    ("zbv", "v"),
]
#: Partitions (balance [2, 2, 2, 2]): linear, stash | tanh, split | join, linear | pop,
#: linear: a skip from partition 0 to 3 (one rank with "v", two with "loop") and a tuple
#: with an integer tensor from partition 1 to 2 (one rank with "v", two with "loop").
SKIP_03 = ("linear", "stash", "tanh", "split", "join", "linear", "pop", "linear")
#: linear, stash | tanh, linear | pop, tanh | linear, tanh: a skip from partition 0 to 2
#: (one rank with "loop", two with "v").
SKIP_02 = ("linear", "stash", "tanh", "linear", "pop", "tanh", "linear", "tanh")
RANKS = {"loop": [0, 1, 0, 1], "v": [0, 1, 1, 0]}


@pytest.mark.parametrize("layers", [SKIP_03, SKIP_02], ids=["skip-0-3", "skip-0-2"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("schedule", "placement"), PAIRS)
def test_step_matches_plain_with_two_partitions_per_rank(
    cluster2: Any,
    cases: ModuleType,
    schedule: str,
    placement: str,
    checkpoint: str,
    layers: tuple[str, ...],
) -> None:
    spec = {"layers": layers, "seed": 3, "batches": [8, 7], "chunks": 4}
    results = cluster2.results(
        "step",
        balance=[2, 2, 2, 2],
        checkpoint=checkpoint,
        schedule=schedule,
        placement=placement,
        **spec,
    )
    check_steps(cases, results, **spec)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_a_schedule_of_the_users_runs_on_two_partitions_per_rank(
    cluster2: Any, cases: ModuleType, placement: str
) -> None:
    """A schedule written for one partition per worker: its lists merged per rank."""
    spec = {"layers": SKIP_03, "seed": 5, "batches": [8, 7], "chunks": 4}
    results = cluster2.results(
        "step", balance=[2, 2, 2, 2], schedule="in-order", placement=placement, **spec
    )
    assert all(result["schedule_asked"] for result in results)  # the steps ran it
    check_steps(cases, results, **spec)


#: A first layer that takes keyword inputs and returns a dict, then dicts and
#: ModelOutput-like OrderedDicts between partitions (balance [2, 2, 2, 2]).
MAPPINGS = ("todict", "dict2out", "out2dict", "dict2out", "frommap", "tanh", "linear", "tanh")


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(("schedule", "placement"), PAIRS)
def test_mappings_and_keyword_inputs_with_two_partitions_per_rank(
    cluster2: Any, cases: ModuleType, schedule: str, placement: str, checkpoint: str
) -> None:
    spec = {"layers": MAPPINGS, "seed": 7, "batches": [8, 7], "chunks": 4}
    results = cluster2.results(
        "step", balance=[2, 2, 2, 2], checkpoint=checkpoint, schedule=schedule,
        placement=placement, keywords=True, give_all=placement == "v", **spec,
    )  # fmt: skip
    check_steps(cases, results, **spec)


@st.composite
def random_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A random model of linear and tanh layers with a skip between any two positions
    (or none), or of layers that pass dicts and ModelOutput-like mappings (the first taking
    keyword inputs, or not), split into any four partitions, on any schedule and
    placement."""
    keywords = False
    if draw(st.booleans()):
        kinds = draw(st.lists(st.sampled_from(["linear", "tanh"]), min_size=4, max_size=7))
        if draw(st.booleans()):
            a = draw(st.integers(0, len(kinds)))
            b = draw(st.integers(a, len(kinds)))
            kinds = [*kinds[:a], "stash", *kinds[a:b], "pop", *kinds[b:]]
        if "linear" not in kinds:
            kinds.append("linear")
    else:
        middle = draw(st.lists(st.just(["dict2out", "out2dict"]), min_size=0, max_size=2))
        after = draw(st.lists(st.sampled_from(["linear", "tanh"]), min_size=0, max_size=2))
        kinds = ["todict", *(k for pair in middle for k in pair), "dict2out", "frommap", *after]
        kinds += ["linear"] * max(0, 4 - len(kinds))
        keywords = draw(st.booleans())
    schedule, placement = draw(st.sampled_from(PAIRS))
    return {
        "keywords": keywords,
        "layers": tuple(kinds),
        "balance": draw(st.sampled_from(compositions(len(kinds), 4))),
        "schedule": schedule,
        "placement": placement,
        "checkpoint": draw(st.sampled_from(MODES)),
        # 1, 2 or 4 micro-batches: what interleaved rounds on two workers take.
        "chunks": draw(st.sampled_from([1, 2, 4])),
        "seed": draw(st.integers(0, 2**16)),
        "batches": [8],
    }


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=random_cases())
def test_random_models_match_plain_with_two_partitions_per_rank(
    cluster2: Any, cases: ModuleType, case: dict[str, Any]
) -> None:
    results = cluster2.results("step", **case)
    check_steps(cases, results, **case)


@pytest.mark.parametrize(("schedule", "placement"), [("zb-h1", "loop"), ("zbv", "v")])
def test_deferred_batch_norm_with_two_partitions_per_rank(
    cluster2: Any, cases: ModuleType, schedule: str, placement: str
) -> None:
    spec = {"layers": ("linear", "tanh", "linear", "bn", "linear", "tanh", "linear", "linear"),
            "seed": 6, "batches": [8, 16], "chunks": 4}  # fmt: skip
    results = cluster2.results(
        "step", balance=[2, 2, 2, 2], schedule=schedule, placement=placement,
        deferred_batch_norm=True, **spec,
    )  # fmt: skip
    check_steps(cases, results, **spec)


@pytest.mark.parametrize(("schedule", "placement"), [("zb-h1", "loop"), ("zbv", "v")])
def test_messages_between_partitions_of_one_rank_stay_off_the_transport(
    cluster2: Any, cases: ModuleType, schedule: str, placement: str
) -> None:
    spec = {"layers": SKIP_03, "seed": 4, "batches": [8], "chunks": 4}
    results = cluster2.results(
        "step", balance=[2, 2, 2, 2], schedule=schedule, placement=placement,
        record_wire=True, **spec,
    )  # fmt: skip
    check_steps(cases, results, **spec)
    ranks = RANKS[placement]
    for rank, result in enumerate(results):
        sent = set(result["wire"])
        # Only messages from this rank's partitions to the other rank's.
        assert sent, rank
        assert all(ranks[source] == rank != ranks[target] for _, source, target in sent), sent
        # Every message between the ranks went through it: activations and gradients
        # between neighbours on two ranks, the skip and its gradient where they cross.
        expected = set()
        for j in range(3):
            if ranks[j] != ranks[j + 1]:
                expected |= {("activations", j, j + 1), ("gradients", j + 1, j)}
        if ranks[0] != ranks[3]:
            expected |= {("skips", 0, 3), ("skip-gradients", 3, 0)}
        assert sent == {key for key in expected if ranks[key[1]] == rank}


@pytest.mark.parametrize(
    ("field", "message"),
    [
        (
            "placement",
            "placement differs across ranks (rank 0: [0, 1, 0, 1], rank 1: [0, 1, 1, 0])",
        ),
        ("no placement", "placement differs across ranks (rank 0: [0, 1, 0, 1], rank 1: None)"),
        ("schedule", "schedule differs across ranks (rank 0: 'interleaved-1f1b', rank 1: 'zb-h1')"),
    ],
)
def test_ranks_that_disagree_on_placement_or_schedule_raise_the_same_error(
    cluster2: Any, cases: ModuleType, field: str, message: str
) -> None:
    results = cluster2.results("disagree_placement", field=field, odd_rank=1)
    same_value_error(results, message)
    # A placement is checked as the pipeline is built, a schedule as it steps.
    assert all(result.get("built", False) == (field == "schedule") for result in results)
    check_alike(cases, results)


def test_a_rank_refuses_partitions_on_two_devices_under_a_placement() -> None:
    from gpipe_core._placement import _check_one_device

    _check_one_device([torch.device("cpu")] * 2, 0, "loop")
    with pytest.raises(
        ValueError,
        match=r"with placement, the partitions of a rank run on its one worker and must share "
        r"one device \(placement: 'v', rank: 1, devices of its partitions: \['cpu', 'cuda:0'\]\)",
    ):
        _check_one_device([torch.device("cpu"), torch.device("cuda:0")], 1, "v")


#: Partitions [2, 1, 2, 1]: linear, trap | tanh | linear, trap | linear (the traps on rank
#: 0 with "loop", on both ranks with "v").
TRAPPED = ("linear", "trap", "tanh", "linear", "trap", "linear")


@pytest.mark.parametrize(
    ("schedule", "placement", "trap_rank", "phase"),
    [
        ("zb-h1", "loop", 0, "forward"),
        ("zb-h1", "loop", 0, "backward"),
        ("interleaved-1f1b", "loop", 0, "recompute"),
        ("zbv", "v", 1, "backward"),
        ("zbv", "v", 0, "recompute"),
    ],
)
def test_a_failing_partition_fails_every_rank_then_the_next_step_runs(
    cluster2: Any, cases: ModuleType, schedule: str, placement: str, trap_rank: int, phase: str
) -> None:
    chunks, seed = 4, 4
    results = cluster2.results(
        "failure", layers=TRAPPED, balance=[2, 1, 2, 1], seed=seed, chunks=chunks,
        trap_rank=trap_rank, phase=phase, microbatch=1, schedule=schedule,
        placement=placement, timeout=60,
    )  # fmt: skip
    for rank, result in enumerate(results):
        expected = "Fail" if rank == trap_rank else "RemotePartitionError"
        assert result["error"]["type"] == expected, (rank, result["error"])
    # The next step: the plain model's loss and gradients.
    model = cases.build(TRAPPED, seed)
    x, y = cases.data(seed + 1, 2 * chunks)
    per_micro = [
        torch.nn.functional.mse_loss(model(xi), yi) * len(xi) / len(x)
        for xi, yi in zip(x.chunk(chunks), y.chunk(chunks), strict=True)
    ]
    torch.autograd.backward(per_micro)
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        torch.testing.assert_close(result["reduced"], sum(loss.item() for loss in per_micro))
        grads.update(result["grads"])  # the plain module's names
    expected_grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
