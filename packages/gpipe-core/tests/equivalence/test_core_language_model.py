"""A language model's training loop, across partitions and ranks: a token embedding and an
output head that share one weight (tied, in different partitions), Adam, the global
gradient norm clipped, and model and optimizer checkpoints that move between layouts.

Every run is compared with the plain model trained alike (float64), step by step: the
losses, the total gradient norm, and every parameter after the optimizer's step. The
largest difference seen is printed (``-s``) for the multi-rank runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gpipe_core._shared as gpipe_shared
from core_support.models import MODES
from gpipe_core import GPipe

SCHEDULES = ("gpipe", "1f1b")
STEPS = 3


def plain_run(cases: ModuleType, seed: int, steps: int, **spec: Any) -> list[dict[str, Any]]:
    model = cases.language_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return cases.lm_steps(model, optimizer, seed=seed, first=0, steps=steps, **spec)  # type: ignore[no-any-return]


def compare(got: list[list[dict[str, Any]]], want: list[dict[str, Any]], first: int = 0) -> float:
    """Each rank's steps (``got[rank]``) against the plain model's from step ``first``:
    the same loss and total norm on every rank, and every rank's state; the largest
    difference."""
    worst = 0.0
    for k, steps in enumerate(zip(*got, strict=True)):
        expected = want[first + k]
        seen: set[str] = set()
        for rank, step in enumerate(steps):
            assert step["norm"] == steps[0]["norm"], f"rank {rank} clips by another norm"
            if expected["loss"] is not None:
                torch.testing.assert_close(step["loss"], expected["loss"], msg=f"step {k}")
                worst = max(worst, abs(step["loss"] - expected["loss"]))
            torch.testing.assert_close(step["norm"], expected["norm"], msg=f"step {k}")
            for key, value in step["state"].items():
                torch.testing.assert_close(value, expected["state"][key], msg=f"{key}, step {k}")
                worst = max(worst, (value - expected["state"][key]).abs().max().item())
                seen.add(key)
        assert seen == expected["state"].keys()  # every layer is on some rank
    return worst


# -- one process: two partitions on the CPU -----------------------------------------------------


@pytest.fixture(params=["one tensor", "tied copy"])
def tie(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether partitions on one device use a copy tied to the owner, as partitions on
    different devices do (the ties' mechanism on the CPU), or the shared tensor itself."""
    tied = bool(request.param == "tied copy")
    monkeypatch.setattr(gpipe_shared, "TIE_ONE_DEVICE", tied)
    return tied


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_tied_model_trains_as_the_plain_one_in_one_process(
    cases: ModuleType, schedule: str, checkpoint: str, tie: bool
) -> None:
    spec = {"batch": 6, "chunks": 3, "max_norm": 0.5}
    pipe = GPipe(cases.language_model(1), [3, 3], chunks=3, checkpoint=checkpoint)
    assert pipe[0].weight is pipe[5].weight  # between runs, as in the plain model
    assert next(name for name, _ in pipe.named_parameters()) == "0.weight"
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    got = cases.lm_steps(pipe, optimizer, seed=1, first=0, steps=STEPS, schedule=schedule, **spec)
    compare([got], plain_run(cases, 1, STEPS, **spec))
    assert pipe.shared_drift() == {}
    assert pipe[0].weight is pipe[5].weight


@pytest.mark.parametrize(
    ("placement", "schedule"),
    [("v", "zbv"), ("v", "1f1b"), ("loop", "interleaved-1f1b"), ("loop", "zb-h1")],
)
@pytest.mark.parametrize("checkpoint", MODES)
def test_tied_model_with_several_partitions_per_worker(
    cases: ModuleType, placement: str, schedule: str, checkpoint: str, tie: bool
) -> None:
    """The embedding and the head on one worker (V placement) or on two (loop), with the
    interleaved and zero-bubble schedules: the plain model's numbers at every step."""
    spec = {"batch": 8, "chunks": 4, "max_norm": 0.5}
    pipe = GPipe(
        cases.language_model(2),
        [1, 2, 2, 1],
        chunks=4,
        checkpoint=checkpoint,
        devices=["cpu", "cpu"],
        placement=placement,
    )
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    got = cases.lm_steps(pipe, optimizer, seed=2, first=0, steps=STEPS, schedule=schedule, **spec)
    compare([got], plain_run(cases, 2, STEPS, **spec))
    assert pipe[0].weight is pipe[5].weight


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_tied_copy_takes_the_gradient_to_the_owner_in_forward_and_backward(
    cases: ModuleType, checkpoint: str, tie: bool
) -> None:
    """``forward()`` and the caller's ``backward()``: autograd takes the copy's gradient to
    the owner's ``.grad``, recomputations included; the pipeline copies and saves as the
    plain model does."""
    plain = cases.language_model(2)
    pipe = GPipe(copy.deepcopy(plain), [2, 4], chunks=3, checkpoint=checkpoint)
    seen: list[bool] = []  # whether the head runs with the owner itself
    pipe[5].register_forward_pre_hook(
        lambda layer, args: seen.append(layer.weight is pipe[0].weight)
    )
    x, y = cases.tokens(2, 6)
    for _ in range(2):  # the second time after an update of the owner
        for model in (plain, pipe):
            model.zero_grad()
            cases.TokenLoss()(model(x), y).backward()
            with torch.no_grad():
                model[0].weight -= 0.1 * model[0].weight.grad
        torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad)
        torch.testing.assert_close(pipe.state_dict(), plain.state_dict())
    assert seen and seen == [not tie] * len(seen)
    state = {key: value + 0.5 for key, value in plain.state_dict().items()}
    state["5.weight"] = state["0.weight"]  # one tensor, as the tie makes it
    torch.testing.assert_close(
        torch.func.functional_call(pipe, state, (x,)),
        torch.func.functional_call(plain, state, (x,)),
    )
    clone = copy.deepcopy(pipe)
    assert clone[0].weight is clone[5].weight and clone[0].weight is not pipe[0].weight
    torch.testing.assert_close(clone(x), plain(x))
    unwrapped = copy.deepcopy(pipe.unwrap())
    assert unwrapped[0].weight is unwrapped[5].weight
    torch.testing.assert_close(unwrapped(x), plain(x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tied_model_on_the_cpu_and_a_gpu_trains_as_the_plain_one(
    cases: ModuleType, schedule: str
) -> None:
    """The embedding (the owner) on the CPU, the head on the GPU with a tied copy: real
    device-to-device copies, and the gradient back to the owner's ``.grad``."""
    spec = {"batch": 6, "chunks": 3, "max_norm": 0.5}
    pipe = GPipe(cases.language_model(1), [3, 3], devices=["cpu", "cuda:0"], chunks=3)
    assert pipe[0].weight is pipe[5].weight and pipe[0].weight.device.type == "cpu"
    assert pipe[4].weight.device.type == "cuda"
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.05)
    got = cases.lm_steps(pipe, optimizer, seed=1, first=0, steps=STEPS, schedule=schedule, **spec)
    for step in got:
        step["state"] = {key: value.cpu() for key, value in step["state"].items()}
    compare([got], plain_run(cases, 1, STEPS, **spec))


@st.composite
def tied_models(draw: st.DrawFn) -> tuple[nn.Sequential, list[int]]:
    """Linear and tanh layers, some linears sharing an earlier linear's weight or bias, and
    a balance."""
    count = draw(st.integers(2, 7))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    layers: list[nn.Module] = []
    for k in range(count):
        if k and draw(st.booleans()):
            layers.append(nn.Tanh())
            continue
        layer = nn.Linear(3, 3)
        earlier = [m for m in layers if isinstance(m, nn.Linear)]
        if earlier and draw(st.booleans()):
            source = draw(st.sampled_from(earlier))
            which = draw(st.sampled_from(["weight", "bias", "both"]))
            if which in ("weight", "both"):
                layer.weight = source.weight
            if which in ("bias", "both"):
                layer.bias = source.bias
        layers.append(layer)
    cuts = sorted(draw(st.sets(st.integers(1, count - 1), max_size=count - 1)))
    balance = [b - a for a, b in zip([0, *cuts], [*cuts, count], strict=True)]
    return nn.Sequential(*layers).double(), balance


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tied_models(),
    st.sampled_from(SCHEDULES),
    st.sampled_from(MODES),
    st.sampled_from([2.0, 1.0, float("inf")]),
    st.booleans(),
)
def test_random_sharing_patterns_match_the_plain_model(
    model_balance: tuple[nn.Sequential, list[int]],
    schedule: str,
    checkpoint: str,
    norm_type: float,
    tied: bool,
) -> None:
    plain, balance = model_balance
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpipe_shared, "TIE_ONE_DEVICE", tied)
        pipe = GPipe(copy.deepcopy(plain), balance, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
        (nn.MSELoss()(plain(xi), yi) / 2).backward()
    total = pipe.clip_grad_norm_(0.1, norm_type)
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type)
    torch.testing.assert_close(total, want)
    got = dict(pipe.named_parameters())
    assert list(got) == [name for name, _ in plain.named_parameters()]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, msg=name)


# -- across processes ---------------------------------------------------------------------------


def lm(cluster: Any, **spec: Any) -> list[list[dict[str, Any]]]:
    results = cluster.results("lm", **spec)
    for result in results:
        assert all(drift == 0.0 for drift in result["drift"].values()), result["drift"]
    return [result["steps"] for result in results]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_tied_model_trains_as_the_plain_one_on_two_ranks(
    cluster2: Any, cases: ModuleType, schedule: str, checkpoint: str
) -> None:
    spec = {"batch": 6, "chunks": 3, "max_norm": 0.5}
    results = cluster2.results(
        "lm", balance=[2, 4], seed=2, steps=STEPS, schedule=schedule, checkpoint=checkpoint, **spec
    )
    # The head's replica of the embedding's weight is named as in the plain model.
    assert results[1]["names"][0] == "0.weight" and "5.weight" not in results[1]["names"]
    assert results[0]["drift"] == results[1]["drift"] == {"0.weight": 0.0}
    worst = compare([r["steps"] for r in results], plain_run(cases, 2, STEPS, **spec))
    print(f"two ranks, {schedule}, {checkpoint}: max difference to the plain model {worst:.3g}")


def test_replicas_replaced_by_a_load_with_assign_are_followed(
    cluster2: Any, cases: ModuleType
) -> None:
    spec = {"batch": 6, "chunks": 3, "max_norm": 0.5}
    got = lm(cluster2, balance=[2, 4], seed=2, steps=2, assign=True, **spec)
    compare(got, plain_run(cases, 2, 2, **spec))


def test_tied_model_on_four_ranks_and_two_partitions_per_rank(
    new_cluster_module: Callable[[int], Any], cluster2: Any, cases: ModuleType
) -> None:
    spec = {"batch": 8, "chunks": 4, "max_norm": 0.3}
    want = plain_run(cases, 3, STEPS, **spec)
    cluster4 = new_cluster_module(4)
    got = lm(cluster4, balance=[2, 1, 1, 2], seed=3, steps=STEPS, schedule="1f1b", **spec)
    worst = compare(got, want)
    print(f"four ranks: max difference to the plain model {worst:.3g}")
    # Partitions 0 and 2 on rank 0, 1 and 3 (the head) on rank 1.
    got = lm(cluster2, balance=[1, 2, 2, 1], seed=3, steps=STEPS, **spec)
    worst = compare(got, want)
    print(f"two ranks, two partitions each: max difference to the plain model {worst:.3g}")


def test_pipelines_times_data_parallel_replicas_clip_by_the_plain_norm(
    new_cluster_module: Callable[[int], Any], cases: ModuleType
) -> None:
    """Two pipelines of two ranks, each on half of the batch, their replicas averaged
    (``data_group``): the shared weight's gradient summed in each pipeline, then averaged,
    and the norm of the whole model's gradient counted once, not once per replica."""
    spec = {"batch": 4, "chunks": 2, "max_norm": 0.3}
    want = plain_run(cases, 5, STEPS, batch=8, chunks=4, max_norm=0.3)
    got = lm(new_cluster_module(4), balance=[3, 3], seed=5, steps=STEPS, data_parallel=True, **spec)
    for steps in got:  # the losses are each replica's half
        for step in steps:
            step["loss"] = None
    for step in want:
        step["loss"] = None
    worst = compare(got[:2], want)
    assert compare(got[2:], want) == worst
    print(f"two pipelines x two replicas: max difference to the plain model {worst:.3g}")


@pytest.mark.parametrize("checkpoint", MODES)
def test_gradients_accumulated_over_steps_are_summed_once(
    cluster2: Any, cases: ModuleType, checkpoint: str
) -> None:
    """Each step sums only what it adds to the replicas' gradients, and a step without
    backward passes (eval mode) sums nothing."""
    results = cluster2.results("lm_accumulate", checkpoint=checkpoint)
    model = cases.language_model(8)
    for k in range(2):
        x, y = cases.tokens(9 + k, 4)
        for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
            (cases.TokenLoss()(model(xi), yi) / 2).backward()
    assert results[0]["grads"].keys() & results[1]["grads"].keys() == {"0.weight"}
    for result in results:
        assert result["untouched"]
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, model.get_parameter(name).grad, msg=name)


#: The gates of each step of :func:`cases.gated_steps` and whether it zeroes the gradients
#: first: every use of the tied weight on; every use skipped (no gradient anywhere: the
#: plain model keeps None, and SGD's momentum leaves the weight alone); one use on, on one
#: rank (the others get its gradient); every use skipped again without zeroing (the
#: gradient stays what it was); the middle use only.
GATED_PLAN = [
    ({}, True),
    ({"first": False, "middle": False, "last": False}, True),
    ({"first": False, "middle": False}, True),
    ({"first": False, "middle": False, "last": False}, False),
    ({"first": False, "last": False}, True),
]


@pytest.mark.parametrize("world", [2, 3])
def test_a_tied_weight_without_gradient_on_any_rank_keeps_none(
    new_cluster_module: Callable[[int], Any], cluster2: Any, cases: ModuleType, world: int
) -> None:
    """A step in which no use of a shared parameter computes a gradient, on any rank,
    leaves its ``.grad`` as the plain model's (None, or what it held), not zeros that an
    optimizer with momentum would follow; a step in which some rank computes one gives
    every rank the sum."""
    cluster = cluster2 if world == 2 else new_cluster_module(3)
    results = cluster.results("gated_tied", plan=GATED_PLAN)
    want = cases.gated_steps(cases.gated_tied_model(3), GATED_PLAN, seed=3)
    tied = "0.layer.weight"
    assert all(tied in result["steps"][0]["grads"] for result in results)  # a replica each
    for k, expected in enumerate(want):
        for rank, result in enumerate(results):
            got = result["steps"][k]
            assert got["grads"].keys() <= expected["grads"].keys()
            for name, grad in got["grads"].items():
                where = f"{name}, rank {rank}, step {k}"
                if expected["grads"][name] is None:
                    assert grad is None, where
                else:
                    assert grad is not None, where
                    torch.testing.assert_close(grad, expected["grads"][name], msg=where)
                torch.testing.assert_close(got["values"][name], expected["values"][name], msg=where)
    assert want[1]["grads"][tied] is None  # the plan does what it says
    torch.testing.assert_close(want[1]["values"][tied], want[0]["values"][tied], rtol=0, atol=0)
    for result in results:
        assert result["drift"] == {tied: 0.0}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_every_rank_clips_by_the_plain_models_total_norm(
    cluster2: Any, cases: ModuleType, norm_type: float
) -> None:
    results = cluster2.results("clip", norm_type=norm_type, max_norm=0.05, poison=False)
    model = cases.language_model(7)
    x, y = cases.tokens(7, 4)
    for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
        (cases.TokenLoss()(model(xi), yi) / 2).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type)
    assert results[0]["error"] == results[1]["error"] == {}
    assert results[0]["total"] == results[1]["total"]  # the same factor on every rank
    torch.testing.assert_close(results[0]["total"], total.item())
    assert results[0]["grads"].keys() & results[1]["grads"].keys() == {"0.weight"}
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, model.get_parameter(name).grad, msg=name)


def test_a_nonfinite_norm_is_refused_on_every_rank_or_scaled_by(cluster2: Any) -> None:
    results = cluster2.results("clip", norm_type=2.0, max_norm=1.0, poison=True)
    for result in results:
        assert result["error"]["type"] == "RuntimeError", result
        assert result["error"]["message"].startswith(
            "the total norm of the gradients is not finite (norm_type: 2.0, total norm: inf)"
        )
        assert result["total"] == float("inf")  # error_if_nonfinite=False: as torch does
        # Scaled by 1 / inf, as torch scales: zero, and nan where the gradient was inf.
        assert all(((g == 0) | g.isnan()).all() for g in result["grads"].values())


def test_ranks_clipping_differently_all_raise_the_same_error(cluster2: Any) -> None:
    results = cluster2.results("clip_disagree")
    message = "max_norm differs across ranks (rank 0: 1.0, rank 1: 2.0)"
    for result in results:
        assert result["error"]["type"] == "RanksDisagree", result
        assert result["error"]["message"] == message
        assert result["unchanged"]
    assert results[0]["total"] == results[1]["total"]  # the next call runs


def test_clip_arguments_are_checked(cases: ModuleType) -> None:
    pipe = GPipe(cases.language_model(0), [3, 3])
    with pytest.raises(TypeError, match=r"max_norm must be a number \(max_norm: '1'\)"):
        pipe.clip_grad_norm_("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"norm_type must be a number \(norm_type: None\)"):
        pipe.clip_grad_norm_(1.0, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"error_if_nonfinite must be True or False"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"max_norm must be a number \(max_norm: True\)"):
        pipe.clip_grad_norm_(True)
    with pytest.raises(TypeError, match=r"norm_type must be a number \(norm_type: \(2\+0j\)\)"):
        pipe.clip_grad_norm_(1.0, 2 + 0j)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"max_norm must be a number, or a tensor or array of one real number "
        r"\(max_norm: Tensor of shape \(2,\), dtype float32\)",
    ):
        pipe.clip_grad_norm_(torch.ones(2))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"norm_type must be a number or a string of one, such as 'inf' "
        r"\(norm_type: 'fro'\)",
    ):
        pipe.clip_grad_norm_(1.0, "fro")  # type: ignore[arg-type]


#: Arguments of clip_grad_norm_ that torch takes, made from NumPy (None where they need none:
#: NumPy is not among the tests' requirements).
CLIP_NUMBERS: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "0-dim tensors": lambda np: (torch.tensor(0.05), torch.tensor(2.0)),
    "0-dim float64 and int tensors": lambda np: (
        torch.tensor(0.05, dtype=torch.float64),
        torch.tensor(1),
    ),
    "a tensor of one element and 'inf'": lambda np: (torch.tensor([0.05]), "inf"),
    "numpy float32 and int64": lambda np: (np.float32(0.05), np.int64(2)),
    "numpy float64 and float32": lambda np: (np.float64(0.05), np.float32(1.0)),
    "a 0-dim numpy array and numpy inf": lambda np: (np.array(0.05), np.float64("inf")),
}


@pytest.mark.parametrize("numbers", sorted(CLIP_NUMBERS))
def test_clip_takes_the_numbers_torch_takes(cases: ModuleType, numbers: str) -> None:
    """NumPy numbers, tensors and arrays of one element, and ``'inf'``, as torch's
    clip_grad_norm_ takes them: the same total and the same clipped gradients."""
    np = pytest.importorskip("numpy") if "numpy" in numbers else None
    max_norm, norm_type = CLIP_NUMBERS[numbers](np)
    model = cases.language_model(7)
    pipe = GPipe(copy.deepcopy(model), [3, 3], chunks=2)
    x, y = cases.tokens(7, 4)
    pipe.step(x, y, cases.TokenLoss())
    for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
        (cases.TokenLoss()(model(xi), yi) / 2).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    total = pipe.clip_grad_norm_(max_norm, norm_type)
    torch.testing.assert_close(total, want)
    for (name, got), p in zip(pipe.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, p.grad, msg=name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_with_the_optimizer_state_moves_between_layouts(
    new_cluster_module: Callable[[int], Any], cluster2: Any, cases: ModuleType, tmp_path: Any
) -> None:
    """Model and Adam state saved with torch.distributed.checkpoint from two ranks load into
    four ranks, into another balance and into the plain model, and from the plain model into
    two ranks; training goes on to the plain model's numbers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    spec = {"batch": 8, "chunks": 4, "max_norm": 0.3}
    want = plain_run(cases, 4, 4, **spec)
    path = str(tmp_path / "from-two-ranks")
    compare(lm(cluster2, balance=[2, 4], seed=4, steps=2, save=path, **spec), want)
    cluster4 = new_cluster_module(4)
    worst = compare(
        lm(cluster4, balance=[1, 2, 2, 1], seed=4, first=2, steps=2, load=path, **spec), want, 2
    )
    print(f"resumed on four ranks: max difference to the plain model {worst:.3g}")
    compare(lm(cluster2, balance=[4, 2], seed=4, first=2, steps=2, load=path, **spec), want, 2)

    # Into the plain model and its optimizer, in this process.
    model = cases.language_model(99)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model_state, optim_state = get_state_dict(model, optimizer, options=cases.flat_options())
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=cases.flat_options(),
    )  # fmt: skip
    compare([cases.lm_steps(model, optimizer, seed=4, first=2, steps=2, **spec)], want, 2)

    # From the plain model (one copy of the tied weight and its state) into two ranks.
    model = cases.language_model(4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    cases.lm_steps(model, optimizer, seed=4, first=0, steps=2, **spec)
    model_state, optim_state = get_state_dict(model, optimizer, options=cases.flat_options())
    plain_path = str(tmp_path / "from-plain")
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=plain_path, no_dist=True)
    got = lm(cluster2, balance=[3, 3], seed=4, first=2, steps=2, load=plain_path, **spec)
    compare(got, want, 2)
