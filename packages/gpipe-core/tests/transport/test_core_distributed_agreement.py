"""Across processes, nothing silently wrong and nothing that waits for the timeout.

Ranks set up differently (another balance, chunks, schedule; one rank in eval mode or
under ``torch.no_grad()``) all raise the same ``ValueError`` naming the field and each
rank's value; a constructor that fails on one rank, an exception that cannot be printed,
two threads or a re-entrant hook, and a rank that never steps end on every rank within
the timeout, with a clear error; after each, the next step gives the plain model's numbers.
The ranks are processes started by the ``cluster2``/``new_cluster`` fixtures (see
``distributed_cases.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from core_support.distributed_checks import PROMPT, check_alike, same_value_error


@pytest.fixture(scope="module")
def cluster4(new_cluster_module: Callable[[int], Any]) -> Any:
    return new_cluster_module(4)


@pytest.fixture(scope="module")
def cluster3(new_cluster_module: Callable[[int], Any]) -> Any:
    return new_cluster_module(3)


# -- the ranks agree when the pipeline is built ------------------------------------------------

BUILD_MESSAGES = {
    "balance": "balance differs across ranks (rank 0: [3, 3], rank 1: [2, 4])",
    "chunks": "chunks differs across ranks (rank 0: 2, rank 1: 4)",
    "checkpoint": "checkpoint differs across ranks (rank 0: 'except_last', rank 1: 'never')",
    "deferred_batch_norm": (
        "deferred_batch_norm differs across ranks (rank 0: False, rank 1: True)"
    ),
    "layers": "layer 1 differs across ranks (rank 0: '1': Tanh(), rank 1: '1': ReLU())",
}


@pytest.mark.parametrize("field", sorted(BUILD_MESSAGES))
def test_ranks_built_differently_all_raise_the_same_error(
    cluster2: Any, cases: ModuleType, field: str
) -> None:
    results = cluster2.results("disagree_build", field=field, odd_rank=1)
    same_value_error(results, BUILD_MESSAGES[field])
    assert all(result["unchanged"] for result in results)  # nothing changed before the check
    check_alike(cases, results)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        (
            "balance",
            "balance differs across ranks (ranks 0, 1, 3: [2, 1, 1, 2], rank 2: [1, 2, 1, 2])",
        ),
        ("chunks", "chunks differs across ranks (ranks 0, 1, 3: 2, rank 2: 4)"),
    ],
)
def test_four_ranks_built_differently(
    cluster4: Any, cases: ModuleType, field: str, message: str
) -> None:
    results = cluster4.results("disagree_build", field=field, odd_rank=2)
    same_value_error(results, message)
    check_alike(cases, results)


# -- the ranks agree at every run ---------------------------------------------------------------

RUN_MESSAGES = {
    "schedule": "schedule differs across ranks (rank 0: 'gpipe', rank 1: '1f1b')",
    "training mode": "training mode differs across ranks (rank 0: True, rank 1: False)",
    "grad mode": "grad mode differs across ranks (rank 0: True, rank 1: False)",
    "autocast": "autocast differs across ranks (rank 0: off, rank 1: cpu bfloat16)",
    "reduction": "reduction differs across ranks (rank 0: 'mean', rank 1: 'sum')",
    "chunks": "chunks differs across ranks (rank 0: 2, rank 1: 4)",
    "the method called": (
        "the method called differs across ranks (rank 0: 'step', rank 1: 'clip_grad_norm_')"
    ),
}


@pytest.mark.parametrize("field", sorted(RUN_MESSAGES))
def test_ranks_stepping_differently_all_raise_the_same_error(
    cluster2: Any, cases: ModuleType, field: str
) -> None:
    """One rank in eval mode, under no_grad or autocast, with another ``chunks``, called
    with another schedule or reduction, or calling clip_grad_norm_() instead:
    every rank raises before any gradient is computed."""
    results = cluster2.results("disagree_run", field=field, odd_rank=1)
    same_value_error(results, RUN_MESSAGES[field])
    assert all(result["no_grads_changed"] for result in results)
    check_alike(cases, results)


FIRST_RANK_MESSAGES = {
    "autocast": "autocast differs across ranks (rank 0: cpu bfloat16, rank 1: off)",
    "chunks": "chunks differs across ranks (rank 0: 4, rank 1: 2)",
    "the method called": (
        "the method called differs across ranks (rank 0: 'clip_grad_norm_', rank 1: 'step')"
    ),
}


@pytest.mark.parametrize("field", sorted(FIRST_RANK_MESSAGES))
def test_the_first_rank_stepping_differently(cluster2: Any, cases: ModuleType, field: str) -> None:
    """The rank that differs is the first partition's, which plans the run: the same
    message, the values the other way round."""
    results = cluster2.results("disagree_run", field=field, odd_rank=0)
    same_value_error(results, FIRST_RANK_MESSAGES[field])
    assert all(result["no_grads_changed"] for result in results)
    check_alike(cases, results)


#: The odd rank's value, then the others', of the fields compared at every run.
THREE_RANK_VALUES = {
    "autocast": ("cpu bfloat16", "off"),
    "chunks": ("4", "2"),
    "the method called": ("'clip_grad_norm_'", "'step'"),
}


@pytest.mark.parametrize("odd_rank", [0, 2])
@pytest.mark.parametrize("field", sorted(THREE_RANK_VALUES))
def test_three_ranks_stepping_differently(
    cluster3: Any, cases: ModuleType, field: str, odd_rank: int
) -> None:
    """On three ranks, the first partition's or the last one steps differently: every rank
    raises the same error, naming each rank's value, and then steps alike."""
    results = cluster3.results("disagree_run", field=field, odd_rank=odd_rank)
    odd, even = THREE_RANK_VALUES[field]
    values = (
        f"rank 0: {odd}, ranks 1, 2: {even}"
        if odd_rank == 0
        else (f"ranks 0, 1: {even}, rank 2: {odd}")
    )
    same_value_error(results, f"{field} differs across ranks ({values})")
    assert all(result["no_grads_changed"] for result in results)
    check_alike(cases, results)


@pytest.mark.parametrize("odd_rank", [0, 3])
def test_four_ranks_stepping_differently(cluster4: Any, cases: ModuleType, odd_rank: int) -> None:
    """The rank that differs is the first partition's (whose values the others compare
    with) or another one: the same message either way."""
    results = cluster4.results("disagree_run", field="training mode", odd_rank=odd_rank)
    values = {
        0: "rank 0: False, ranks 1, 2, 3: True",
        3: "ranks 0, 1, 2: True, rank 3: False",
    }[odd_rank]
    same_value_error(results, f"training mode differs across ranks ({values})")
    check_alike(cases, results)


def test_fields_are_compared_in_order_while_the_ranks_name_the_same_ones() -> None:
    """Ranks that call different methods differ in the first field, the method called,
    whatever fields follow; lists that name other fields at a place (a newer version on one
    rank) are shown whole."""
    from gpipe_core.transport._agreement import compare

    step = (("the method called", "step"), ("chunks", 2), ("schedule", "gpipe"))
    clip = (("the method called", "clip_grad_norm_"), ("max_norm", 1.0))
    assert str(compare({0: clip, 1: step})) == (
        "the method called differs across ranks (rank 0: 'clip_grad_norm_', rank 1: 'step')"
    )
    newer = (*step, ("autocast", "off"))
    assert str(compare({0: step, 1: newer})) == (
        "the fields compared differs across ranks (rank 0: the method called, chunks, "
        "schedule, rank 1: the method called, chunks, schedule, autocast)"
    )
    assert compare({0: step, 1: step}) is None


def test_ranks_calling_different_methods(cluster2: Any) -> None:
    results = cluster2.results("mismatch")
    message = "the method called differs across ranks (rank 0: 'step', rank 1: 'forward')"
    for result in results:
        assert result["error"] == {"type": "RanksDisagree", "message": message}
    assert results[0]["reduced"] == results[1]["reduced"]  # the next step runs


# -- failures that reach every rank at once -----------------------------------------------------


@pytest.mark.parametrize("how", ["argument", "to"])
def test_a_constructor_failing_on_one_rank_fails_every_rank(
    cluster2: Any, cases: ModuleType, how: str
) -> None:
    results = cluster2.results("fail_build", how=how, odd_rank=1)
    failed, other = results[1], results[0]
    if how == "argument":
        assert failed["error"]["type"] == "ValueError", failed
        assert "chunks" in failed["error"]["message"]
    else:
        assert failed["error"]["type"] == "Fail", failed
    assert other["error"]["type"] == "RemotePartitionError", other
    assert other["error"]["rank"] == 1
    assert other["error"]["message"].startswith("rank 1 of the pipeline failed in building")
    for result in results:
        assert result["seconds"] < PROMPT, result
    check_alike(cases, results)


def test_an_exception_that_cannot_be_printed_still_reaches_every_rank(cluster2: Any) -> None:
    results = cluster2.results("fail_unprintable", odd_rank=1)
    assert results[1]["error"]["type"] == "Unprintable", results[1]
    error = results[0]["error"]
    assert error["type"] == "RemotePartitionError", error
    assert "Unprintable: <the message could not be printed: RuntimeError>" in error["message"]
    assert results[0]["seconds"] < PROMPT
    assert results[0]["reduced"] == results[1]["reduced"]


def test_a_second_thread_is_refused_and_the_first_runs(cluster2: Any, cases: ModuleType) -> None:
    results = cluster2.results("concurrent")
    for result in results:
        error = result["other"]["error"]
        assert error["type"] == "RuntimeError", error
        assert "runs one call at a time, and another thread is running one" in error["message"]
        assert result["other"]["seconds"] < PROMPT
    assert results[0]["first"] == results[1]["first"]
    check_alike(cases, results)


def test_a_hook_calling_the_pipeline_again_fails_the_run_not_the_pipeline(
    cluster2: Any, cases: ModuleType
) -> None:
    results = cluster2.results("reentrant", odd_rank=0)
    assert results[0]["error"]["type"] == "RuntimeError", results[0]
    assert "called from inside its own run" in results[0]["error"]["message"]
    assert results[1]["error"]["type"] == "RemotePartitionError", results[1]
    assert results[1]["error"]["rank"] == 0
    check_alike(cases, results)


def test_copies_of_a_pipeline_across_processes_are_refused(cluster2: Any) -> None:
    results = cluster2.results("copy")
    for result in results:
        for how in ("deepcopy", "save"):
            error = result[how]["error"]
            assert error["type"] == "TypeError", error
            assert re.search(
                r"cannot be copied or pickled.*ranks: \[0, 1\].*unwrap\(\)", error["message"]
            )
        assert result["layers"] == 3  # this rank's layers copy


def test_a_rank_that_never_steps_fails_the_others_within_the_timeout(
    new_cluster: Callable[[int], Any],
) -> None:
    """Within the timeout and a little more (telling the others), not twice the timeout."""
    seconds = 4.0
    results = new_cluster(2).results("never_steps", late_rank=1, seconds=seconds)
    outcome = results[0]
    assert outcome["error"]["type"] == "TimeoutError", outcome
    assert "rank 0 waited 4 s for the gradients of micro-batch" in outcome["error"]["message"]
    assert seconds <= outcome["seconds"] < 1.5 * seconds, outcome["seconds"]


def test_strict_loading_and_layer_names_across_ranks(cluster2: Any) -> None:
    results = cluster2.results("strict_load")
    assert results[0]["keys"][:2] == ["partitions.weight", "partitions.bias"]
    assert results[0]["error"] == {}  # rank 0's layers are all there
    error = results[1]["error"]
    assert error["type"] == "RuntimeError", error
    assert 'Missing key(s) in state_dict: "l3.num_batches_tracked"' in error["message"]
