"""GPipe across processes (``group=``): the plain model's numbers, and no hang.

Each test runs its cases on ranks started by the ``cluster2``/``new_cluster`` fixtures
(subprocesses in one gloo group on 127.0.0.1, one intra-op thread each; see
``distributed_cases.py``). The ranks' losses, gradients and buffers are compared with the
plain ``nn.Sequential`` computed here.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.distributed_checks import check_steps, plain_name
from core_support.models import (
    MODES,
    PLANS,
    REDRAWS,
    Redraws,
    assert_replayed,
    redraws_model,
)
from core_support.strategies import compositions

SCHEDULES = ("gpipe", "1f1b")


# -- equivalence -----------------------------------------------------------------------------

SKIPS_AND_TUPLES = ("linear", "stash", "tanh", "split", "join", "linear", "pop", "linear")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_step_matches_plain(
    cluster2: Any, cases: ModuleType, schedule: str, checkpoint: str
) -> None:
    """Skips from one rank to the other, a tuple with an integer tensor between ranks, an
    uneven last micro-batch and a batch size that changes between steps."""
    spec = {"layers": SKIPS_AND_TUPLES, "seed": 3, "batches": [8, 5, 6], "chunks": 4}
    results = cluster2.results(
        "step", balance=[3, 5], checkpoint=checkpoint, schedule=schedule, **spec
    )
    check_steps(cases, results, **spec)


def test_a_schedule_of_the_users_runs_across_ranks(cluster2: Any, cases: ModuleType) -> None:
    spec = {"layers": SKIPS_AND_TUPLES, "seed": 5, "batches": [8, 5], "chunks": 4}
    results = cluster2.results("step", balance=[3, 5], schedule="in-order", **spec)
    assert all(result["schedule_asked"] for result in results)  # the steps ran it
    check_steps(cases, results, **spec)


def test_a_group_of_another_backend_carries_messages_on_gloo(
    cluster2: Any, cases: ModuleType
) -> None:
    """A group whose backend is not gloo itself (here ``'cpu:gloo'``, as a group of
    ``init_process_group('cpu:gloo,cuda:nccl')`` is on the CPU; NCCL in the ``cuda`` test)
    is accepted: the messages travel on a gloo group of the same ranks."""
    spec = {"layers": SKIPS_AND_TUPLES, "seed": 4, "batches": [8, 6], "chunks": 4}
    results = cluster2.results("step", balance=[3, 5], backend="cpu:gloo", **spec)
    check_steps(cases, results, **spec)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_payloads_and_small_messages_in_one_step(
    cluster2: Any, cases: ModuleType, schedule: str
) -> None:
    """Messages whose tensors do not fit in their header (a payload follows: one tensor
    alone, or a tuple with an integer tensor packed) and messages that do, in one step and
    from step to step, with more messages queued than header receives are posted ahead."""
    spec = {"layers": SKIPS_AND_TUPLES, "seed": 6, "batches": [2048, 7, 1000], "chunks": 16}
    results = cluster2.results("step", balance=[4, 4], schedule=schedule, **spec)
    check_steps(cases, results, **spec)


def test_message_buffers_grow_with_the_messages(cluster2: Any, cases: ModuleType) -> None:
    """The buffers posted ahead grow to the messages' size, up to a limit (here 8 KiB):
    messages that did not fit their header then travel in one piece, messages over the
    limit still travel with a payload, and small messages land in the grown buffers."""
    from gpipe_core.transport._wire import HEADER_BYTES

    limit = 8192
    spec = {"layers": SKIPS_AND_TUPLES, "seed": 7, "batches": [2048, 4096, 7, 2048], "chunks": 16}
    results = cluster2.results("step", balance=[4, 4], inline_limit=limit, **spec)
    check_steps(cases, results, **spec)
    sent = [message for result in results for message in result["sent"]]
    if cluster2.payloads == "strict":
        # Never inline: every message with tensors says they follow on the payload channel.
        assert {layout for layout, _, _ in sent} == {"none", "channel"}, sent
        assert all(capacity <= limit for _, _, capacity in sent)
        return
    assert all(capacity <= limit for _, _, capacity in sent)
    grown = [size for layout, size, _ in sent if layout == "inline" and size > HEADER_BYTES]
    assert grown, "no message travelled in one piece in a grown buffer"
    assert any(layout in ("single", "packed") and cap == limit for layout, _, cap in sent)
    assert any(layout == "inline" and 4 * size < cap for layout, size, cap in sent)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_looped_stages_and_deferred_batch_norm(
    cluster2: Any, cases: ModuleType, schedule: str
) -> None:
    """Four partitions on two ranks (each rank runs two, on two workers); a skip from the
    first to the last partition; deferred batch norm; ranks without the input or target."""
    layers = ("stash", "linear", "bn", "tanh", "linear", "relu", "linear", "pop")
    spec = {"layers": layers, "seed": 5, "batches": [8, 8], "chunks": 4}
    results = cluster2.results(
        "step", balance=[2, 2, 2, 2], schedule=schedule, deferred_batch_norm=True, **spec
    )
    check_steps(cases, results, **spec)


def test_every_rank_may_give_every_argument(cluster2: Any, cases: ModuleType) -> None:
    spec = {"layers": ("linear", "tanh", "linear"), "seed": 9, "batches": [6], "chunks": 3}
    results = cluster2.results("step", balance=[2, 1], give_all=True, **spec)
    check_steps(cases, results, **spec)


KINDS = ("linear", "tanh", "relu", "bn")


@st.composite
def random_specs(draw: st.DrawFn) -> dict[str, Any]:
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5))
    if kinds.count("bn") > 1:
        # The running statistics of a batch norm after another one see the first one's
        # micro-batch normalization: one batch norm is comparable with the whole batch.
        kinds = [kind for kind in kinds if kind != "bn"] + ["bn"]
    layers = (*kinds, "linear")
    parts = draw(st.sampled_from([2, 4] if len(layers) >= 4 else [2]))
    cuts = sorted(
        draw(st.sets(st.integers(1, len(layers) - 1), min_size=parts - 1, max_size=parts - 1))
    )
    bounds = [0, *cuts, len(layers)]
    return {
        "layers": layers,
        "balance": [b - a for a, b in itertools.pairwise(bounds)],
        "seed": draw(st.integers(0, 2**16)),
        "batches": [draw(st.integers(1, 9)) for _ in range(2)],
        "chunks": draw(st.integers(1, 4)),
        "checkpoint": draw(st.sampled_from(MODES)),
        "schedule": draw(st.sampled_from(SCHEDULES)),
    }


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=random_specs())
def test_random_models_match_plain(cluster2: Any, cases: ModuleType, spec: dict[str, Any]) -> None:
    if "bn" in spec["layers"]:
        spec["deferred_batch_norm"] = True
        # Batch norm needs 2 samples in every micro-batch (a batch of 7 in 3 chunks has a
        # micro-batch of 1: 3, 3, 1).
        sizes = [
            len(part) for b in spec["batches"] for part in torch.arange(b).chunk(spec["chunks"])
        ]
        if min(sizes) < 2:
            spec["batches"] = [2 * spec["chunks"]] * 2
    results = cluster2.results("step", **spec)
    check_steps(
        cases,
        results,
        **{key: spec[key] for key in ("layers", "seed", "batches", "chunks")},
    )


def test_inference_with_keyword_inputs_and_a_mapping_output(
    cluster2: Any, cases: ModuleType
) -> None:
    """Keyword inputs given on every rank (read on the first partition's), dicts and a
    ModelOutput-like OrderedDict between the ranks, one gathered on the last rank with its
    type and keys."""
    layers = ("todict", "dict2out", "out2dict", "dict2out")
    spec = {"layers": layers, "balance": [1, 3], "seed": 3, "batch": 7, "chunks": 3}
    outputs = cluster2.results("forward", keywords=True, **spec)
    plain = cases.build(layers, 3).eval()
    x, _ = cases.data(3, 7)
    want = plain(x)
    assert outputs[0] is None
    assert type(outputs[1]) is type(want) and list(outputs[1]) == list(want)
    for key in want:
        torch.testing.assert_close(outputs[1][key], want[key])


def test_inference_returns_the_output_on_the_last_rank(cluster2: Any, cases: ModuleType) -> None:
    layers = ("linear", "stash", "tanh", "linear", "pop", "linear")
    outputs = cluster2.results("forward", layers=layers, balance=[2, 4], seed=2, batch=7, chunks=3)
    plain = cases.build(layers, 2).eval()
    x, _ = cases.data(2, 7)
    assert outputs[0] is None
    torch.testing.assert_close(outputs[1], plain(x))


def test_forward_in_training_points_to_step(cluster2: Any) -> None:
    messages = cluster2.results("forward_in_training")
    for message in messages:
        assert "step(input, target, loss_fn)" in message and "inference only" in message


@pytest.mark.parametrize(
    "timeout", [1e10, datetime.timedelta(days=200000)], ids=["seconds", "timedelta"]
)
def test_a_timeout_past_the_limit_steps_across_ranks(
    cluster2: Any, cases: ModuleType, timeout: object
) -> None:
    """A timeout past what every wait holds (gloo's included, whose deadlines count
    nanoseconds since 1970) is clamped: the steps run as with any other."""
    spec = {"layers": ("linear", "tanh", "linear"), "seed": 4, "batches": [6], "chunks": 2}
    results = cluster2.results("step", balance=[2, 1], pipeline_timeout=timeout, **spec)
    check_steps(cases, results, **spec)


# -- failures --------------------------------------------------------------------------------

TRAPPED = ("linear", "trap", "tanh", "linear", "trap", "linear")


@pytest.mark.parametrize(
    ("trap_rank", "phase", "schedule"),
    [
        (0, "forward", "gpipe"),
        (1, "forward", "1f1b"),
        (0, "recompute", "1f1b"),
        (1, "recompute", "gpipe"),
        (0, "backward", "gpipe"),
        (1, "backward", "1f1b"),
        (1, "loss", "gpipe"),
    ],
)
def test_a_failing_rank_fails_every_rank_then_the_next_step_runs(
    cluster2: Any, cases: ModuleType, trap_rank: int, phase: str, schedule: str
) -> None:
    results = cluster2.results(
        "failure",
        layers=TRAPPED,
        balance=[3, 3],
        seed=4,
        chunks=3,
        trap_rank=trap_rank,
        phase=phase,
        microbatch=1,
        schedule=schedule,
        timeout=60,
    )
    check_nothing_left_posted(cluster2, [result["after_failure"] for result in results])
    for rank, result in enumerate(results):
        error = result["error"]
        if rank == trap_rank:
            # The failing rank raises its own error, with where it happened.
            assert error["type"] == "Fail", error
            number = "micro-batch 1" if phase == "forward" else "micro-batch"
            assert (
                any(
                    f"{phase if phase != 'recompute' else 'backward'} of {number}" in note
                    for note in error["notes"]
                )
                or phase == "loss"
            ), error
        else:
            assert error["type"] == "RemotePartitionError", error
            assert error["rank"] == trap_rank
            assert "micro-batch" in error["where"], error
            # The one failure record names the failing rank and partition across ranks.
            assert " on partition " in error["where"], error
            assert f"rank {trap_rank} of the pipeline failed in" in error["message"], error
            assert "Fail" in error["message"]
    # The next step on the same pipeline: the plain model's numbers.
    model = cases.build(TRAPPED, 4)
    x, y = cases.data(5, 6)
    nn.MSELoss()(model(x), y).backward()
    grads = {}
    for result in results:
        torch.testing.assert_close(result["reduced"], nn.MSELoss()(model(x), y).item())
        grads.update({plain_name(k): v for k, v in result["grads"].items()})
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def check_nothing_left_posted(cluster: Any, states: list[dict[str, Any]]) -> None:
    """After a run ended on every rank (``states``: each rank's ``payloads_state``): the
    ranks use the cluster's payload channel, no operation is pending, and every payload a
    rank sent to another was received there (on the strict channel, some were)."""
    for rank, state in enumerate(states):
        assert state["mode"] == cluster.payloads, state
        assert state["pending"] == {"sends": 0, "receives": 0}, (rank, state)
        for peer, other in enumerate(states):
            if peer != rank:
                assert state["sent"].get(peer, 0) == other["received"].get(rank, 0), states
    if cluster.payloads == "strict":
        assert any(state["sent"] for state in states), states
    else:
        assert not any(state["sent"] or state["received"] for state in states), states


def test_the_ranks_use_the_payload_channel_asked(cluster2: Any) -> None:
    """``GPIPE_STRICT_PAYLOADS=1`` in the ranks' environment (the ``strict`` clusters) puts
    every tensor on the strict channel, each in its own payload; without it, none is."""
    check_nothing_left_posted(cluster2, cluster2.results("payloads"))


@pytest.mark.parametrize(
    ("path", "phase", "trap_rank", "checkpoint"),
    [
        ("forward", "forward", 1, "never"),
        ("gpipe", "forward", 1, "except_last"),
        ("gpipe", "loss", 1, "always"),
        ("1f1b", "backward", 0, "never"),
    ],
)
def test_a_failed_run_frees_its_tensors_on_every_rank(
    cluster2: Any, path: str, phase: str, trap_rank: int, checkpoint: str
) -> None:
    # With the cycle collector off on every rank, only reference counts free the input and
    # the activations: neither the error nor the runner may hold them in a cycle.
    results = cluster2.results(
        "failure_frees", path=path, phase=phase, trap_rank=trap_rank, checkpoint=checkpoint
    )
    for rank, result in enumerate(results):
        expected = "Fail" if rank == trap_rank else "RemotePartitionError"
        assert result["error"] == expected, (rank, result)
        assert result["watched"] > 1, (rank, result)
        assert result["alive"] == 0, (rank, result)


def test_a_dying_rank_fails_the_others_and_later_steps(new_cluster: Callable[[int], Any]) -> None:
    cluster = new_cluster(2)
    replies = cluster.run("die", dying_rank=1, timeout=90)
    assert replies[1][0] == "gone"
    status, result = replies[0][0], replies[0][1]
    assert status == "ok", replies[0]
    assert result["first"]["type"] == "RemotePartitionError", result
    assert "rank 1" in result["first"]["message"] and "died" in result["first"]["message"]
    assert result["second"]["type"] == "RuntimeError", result
    assert "rank 1 of the pipeline's group is gone" in result["second"]["message"]


# -- four ranks: pipeline x data parallel, checkpoints -----------------------------------------


@pytest.fixture(scope="module")
def cluster4(new_cluster_module: Callable[[int], Any]) -> Any:
    return new_cluster_module(4)


def test_four_stages_match_plain(cluster4: Any, cases: ModuleType) -> None:
    spec = {"layers": SKIPS_AND_TUPLES, "seed": 11, "batches": [8, 7], "chunks": 4}
    results = cluster4.results("step", balance=[2, 2, 2, 2], schedule="1f1b", **spec)
    check_steps(cases, results, **spec)


def test_pipeline_times_data_parallel(cluster4: Any, cases: ModuleType) -> None:
    """2 partitions x 2 replicas: the gradients of the whole batch's mean loss, averaged over
    the replicas by one all_reduce per step."""
    layers = ("linear", "tanh", "linear", "relu", "linear")
    results = cluster4.results(
        "data_parallel", layers=layers, balance=[3, 2], seed=6, batch=8, chunks=2
    )
    model = cases.build(layers, 6)
    x, y = cases.data(6, 8)
    nn.MSELoss()(model(x), y).backward()
    grads: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        assert result["all_reduces"] == 1, result
        for name, grad in result["grads"].items():
            name = plain_name(name)
            if name in grads:  # the other replica's partition: the same averaged gradient
                torch.testing.assert_close(grad, grads[name])
            grads[name] = grad
        half = slice((rank // 2) * 4, (rank // 2 + 1) * 4)
        torch.testing.assert_close(result["reduced"], nn.MSELoss()(model(x[half]), y[half]).item())
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_from_two_ranks_loads_into_four_and_into_plain(
    cluster2: Any, cluster4: Any, cases: ModuleType, tmp_path: Any
) -> None:
    import torch.distributed.checkpoint as dcp

    layers = ("linear", "bn", "tanh", "linear", "relu", "linear", "linear")
    path = str(tmp_path / "checkpoint")
    saved = cluster2.results("save", layers=layers, balance=[3, 4], seed=8, path=path)
    assert not set(saved[0]) & set(saved[1])  # each rank saves its own layers
    whole = {**saved[0], **saved[1]}
    # Into the plain model, in this process (no process group).
    plain = cases.build(layers, 99)
    assert whole.keys() == plain.state_dict().keys()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    for key, value in whole.items():
        torch.testing.assert_close(plain.state_dict()[key], value, msg=key)
    # Into four ranks, built on the meta device.
    loaded = cluster4.results("load", layers=layers, balance=[2, 2, 2, 1], path=path, batch=6)
    for rank, result in enumerate(loaded):
        for key, value in result["state"].items():
            torch.testing.assert_close(value, whole[key], msg=key)
        assert result["devices"][rank] == "cpu"
    x, _ = cases.data(1, 6)
    torch.testing.assert_close(loaded[3]["output"], plain.eval()(x))
    assert all(result["output"] is None for result in loaded[:3])


def test_a_balance_that_does_not_fit_the_group(cluster2: Any) -> None:
    results = cluster2.results("bad_balance")
    for result in results:
        assert result["error"] == {
            "type": "ValueError",
            "message": "balance must have a multiple of group.size() partitions, one or more "
            "per rank (partitions: 3, group.size(): 2)",
        }
    assert results[0]["reduced"] == results[1]["reduced"]


def test_a_stalled_step_says_who_waits_for_what(new_cluster: Callable[[int], Any]) -> None:
    results = new_cluster(2).results("stall", late_rank=0, seconds=1.0)
    assert results[1]["type"] == "TimeoutError", results
    assert results[1]["message"] == "rank 1 waited 1 s for the plan of the run from rank 0"
    assert results[0], "the late rank cannot run with a rank that gave up"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_partitions_on_cuda(
    new_cluster: Callable[[int], Any], cases: ModuleType, backend: str
) -> None:
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    layers = ("linear", "tanh", "linear")
    results = new_cluster(2, gpus=True).results(
        "cuda", layers=layers, balance=[2, 1], seed=1, backend=backend
    )
    model = cases.build(layers, 1)
    x, y = cases.data(1, 4)
    loss = nn.MSELoss()(model(x), y)
    loss.backward()
    for result in results:
        assert result["devices"].count("cuda:0") == 1
        torch.testing.assert_close(result["reduced"], loss.item())
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, model.get_parameter(plain_name(name)).grad)


def assert_ranks_match(results: list[dict[str, Any]], model: nn.Module, loss: torch.Tensor) -> None:
    """The ranks' reduced loss is ``loss``, and their gradients together are ``model``'s."""
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        torch.testing.assert_close(result["reduced"], loss.item())
        grads.update({plain_name(k): v for k, v in result["grads"].items()})
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_inputs_of_any_kind_across_ranks(cluster2: Any, cases: ModuleType) -> None:
    results = cluster2.results("inputs", seed=12, chunks=3)
    model = cases.inputs_model(12)
    x, y = cases.data(12, 6)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return model[2](model[1](model[0](x, mask, 0.5)))

    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    assert_ranks_match(results, model, loss)
    assert results[0]["output"] is None
    torch.testing.assert_close(results[1]["output"], plain(x))


@pytest.mark.parametrize(("checkpoint", "schedule"), [("always", "gpipe"), ("except_last", "1f1b")])
def test_tuple_subclasses_keep_their_type_across_ranks(
    cluster2: Any, cases: ModuleType, checkpoint: str, schedule: str
) -> None:
    # torch.return_types.max from rank 1 to rank 0, a namedtuple back to rank 1 and out.
    results = cluster2.results("tuple_types", checkpoint=checkpoint, schedule=schedule)
    model = cases.tuples_model(0)
    x, y = cases.data(0, 6)
    loss = nn.MSELoss()(model(x).a, y)
    loss.backward()
    assert_ranks_match(results, model, loss)
    # The last partition runs on rank 1: its loss and output see the namedtuple.
    assert results[1]["seen"] == ["NamedPair"] * 3
    kind, output = results[1]["output"]
    assert kind == "NamedPair"
    torch.testing.assert_close(output, model(x).a)
    assert results[0]["output"] is None


def test_a_sparse_tensor_between_ranks_is_refused_naming_the_partition(cluster2: Any) -> None:
    sender, receiver = cluster2.results("sparse")
    assert sender["type"] == "TypeError", sender
    assert "from partition 0 to partition 1" in sender["message"]
    assert "layout torch.sparse_coo" in sender["message"]
    assert receiver["type"] == "RemotePartitionError", receiver
    assert "layout torch.sparse_coo" in receiver["message"]


def test_ranks_exit_cleanly_with_a_pipeline_alive(new_cluster: Callable[[int], Any]) -> None:
    """A process that exits while a pipeline across processes is alive exits with 0 (the
    transport's threads end before the interpreter shuts down, not during it, which aborted
    the process: 'terminate called without an active exception')."""
    cluster = new_cluster(2)
    cluster.results("leave")
    cluster.close()
    assert [process.returncode for process in cluster.processes] == [0, 0]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_draws_are_replayed_across_ranks(cluster2: Any, cases: ModuleType, data: Any) -> None:
    """Dropout in layers under torch's checkpoint (reentrant or not) and without, with
    gpipe's checkpointing or none, on every schedule, over two steps (the second one
    with what the first learned): each recomputation on a rank draws its first pass's
    masks, and the plain model given those masks computes the ranks' losses and
    gradients."""
    hows = data.draw(st.lists(st.sampled_from(REDRAWS), min_size=3, max_size=5), "hows")
    schedule, placement = data.draw(st.sampled_from(PLANS), "plan")
    partitions = 4 if placement else 2
    spec = {
        "hows": hows,
        "balance": data.draw(st.sampled_from(compositions(len(hows) + 1, partitions))),
        "chunks": data.draw(st.sampled_from([1, 2, 4]), "chunks"),
        "checkpoint": data.draw(st.sampled_from(MODES), "checkpoint"),
        "schedule": schedule,
        "placement": placement,
        "seed": data.draw(st.integers(0, 2**16), "seed"),
    }
    results = cluster2.results("redraws", **spec)
    model = redraws_model(cases.WIDTH, hows, spec["seed"])
    masks = {name: m for result in results for name, m in result["masks"].items()}
    for name, module in model.named_modules():
        if isinstance(module, Redraws):
            module.masks, module.replay = masks[name], True
    recomputed = assert_replayed(model)
    assert recomputed > 0 or (spec["checkpoint"] != "always" and not any(hows))
    for k in range(2):
        x, y = cases.data(spec["seed"] + k, 8)
        loss = nn.MSELoss()(model(x), y)
        loss.backward()
        assert_ranks_match([result["steps"][k] for result in results], model, loss)
        model.zero_grad(set_to_none=True)
