"""The profilers and balance_by_time / balance_by_size: results, no trace left, errors."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import gpipe_balance._profile as profile_module
from gpipe_balance import (
    BalanceError,
    balance_by_size,
    balance_by_time,
    profile_sizes,
    profile_times,
)
from gpipe_checkpoint import device_rng_lock

# --------------------------------------------------------------------------------------------
# Snapshots of everything profiling must leave alone
# --------------------------------------------------------------------------------------------


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "parameters": [(name, p, p.detach().clone()) for name, p in model.named_parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_objects": [p.grad for p in model.parameters()],
        "buffers": [(name, b, b.clone()) for name, b in model.named_buffers()],
        "training": [m.training for m in model.modules()],
        "devices": [t.device for t in [*model.parameters(), *model.buffers()]],
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert [n for n, _, _ in after["parameters"]] == [n for n, _, _ in before["parameters"]]
    for (_, p_after, v_after), (_, p_before, v_before) in zip(
        after["parameters"], before["parameters"]
    ):
        assert p_after is p_before
        assert torch.equal(v_after, v_before)
    assert after["requires_grad"] == before["requires_grad"]
    for g_after, g_before in zip(after["grads"], before["grads"]):
        assert (g_after is None) == (g_before is None)
        if g_after is not None:
            assert torch.equal(g_after, g_before)
    assert all(a is b for a, b in zip(after["grad_objects"], before["grad_objects"]))
    for (name, b_after, v_after), (_, b_before, v_before) in zip(
        after["buffers"], before["buffers"]
    ):
        assert b_after is b_before, name
        assert torch.equal(v_after, v_before), name
    assert after["training"] == before["training"]
    assert after["devices"] == before["devices"]
    assert torch.equal(after["rng"], before["rng"])


def bn_dropout_model() -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Dropout(0.2),
        nn.Linear(8, 3),
    )
    # Some gradients set, some None; a frozen layer; part of the model in eval mode.
    model[0].weight.grad = torch.randn_like(model[0].weight)
    model[4].requires_grad_(False)
    model[5].eval()
    return model


PROFILERS = {
    "profile_times": lambda m, x: profile_times(m, x, timeout=0),
    "profile_sizes": lambda m, x: profile_sizes(m, x, chunks=2, param_scale=3.0),
    "balance_by_time": lambda m, x: balance_by_time(3, m, x, timeout=0),
    "balance_by_size": lambda m, x: balance_by_size(3, m, x, chunks=2),
}


@pytest.mark.parametrize("profiler", list(PROFILERS))
@pytest.mark.parametrize("training", [True, False])
def test_profiling_leaves_no_trace(profiler: str, training: bool) -> None:
    torch.manual_seed(0)
    model = bn_dropout_model().train(training)
    sample = torch.randn(10, 6)
    sample_before = sample.clone()
    before = snapshot(model)
    PROFILERS[profiler](model, sample)
    assert_unchanged(model, before)
    assert torch.equal(sample, sample_before)
    assert sample.grad is None and not sample.requires_grad


def test_no_trace_detector_sees_changes() -> None:
    # The control: one training step of the model itself is caught by the snapshot.
    torch.manual_seed(0)
    model = bn_dropout_model()
    before = snapshot(model)
    model(torch.randn(10, 6)).sum().backward()
    with pytest.raises(AssertionError):
        assert_unchanged(model, before)
    # Buffers alone (BatchNorm running statistics, no backward) are caught as well.
    model = bn_dropout_model()
    before = snapshot(model)
    with torch.no_grad():
        model[1](torch.randn(10, 8))
    before["rng"] = torch.get_rng_state()
    with pytest.raises(AssertionError):
        assert_unchanged(model, before)


def test_random_draws_after_profiling_are_as_without() -> None:
    model = bn_dropout_model()
    torch.manual_seed(3)
    expected = torch.rand(5)
    sample = torch.randn(4, 6)
    torch.manual_seed(3)
    profile_times(model, sample, timeout=0)
    profile_sizes(model, sample)
    assert torch.equal(torch.rand(5), expected)


# Whether the profiling thread held the CPU generator's lock at each draw of a Drawing layer
# (module level: profiling runs deep copies of the layers).
held_while_drawing: list[bool] = []


class Drawing(nn.Module):
    """Draws random numbers, and records whether its thread holds the generator lock."""

    def forward(self, x: Tensor) -> Tensor:
        lock = device_rng_lock(torch.device("cpu"))
        taken: list[bool] = []

        def try_lock() -> None:
            # Another thread can take the lock only if this one does not hold it.
            taken.append(lock.acquire(blocking=False))
            if taken[-1]:
                lock.release()

        thread = threading.Thread(target=try_lock)
        thread.start()
        thread.join()
        held_while_drawing.append(not taken[0])
        return x + torch.rand_like(x)


@pytest.mark.parametrize("profiler", ["profile_times", "profile_sizes"])
def test_layers_draw_under_the_generator_lock(profiler: str) -> None:
    # A pipeline's checkpointed work holds the lock while it draws, so that its
    # recomputation replays its own draws: profiling draws under the same lock.
    held_while_drawing.clear()
    PROFILERS[profiler](nn.Sequential(Drawing()), torch.randn(2, 3))
    assert held_while_drawing and all(held_while_drawing)
    # The control: outside profiling, the layer sees the lock free.
    held_while_drawing.clear()
    Drawing()(torch.randn(2, 3))
    assert held_while_drawing == [False]


def test_profiling_waits_for_the_generator_lock() -> None:
    lock = device_rng_lock(torch.device("cpu"))
    done = threading.Event()

    def run() -> None:
        profile_sizes(nn.Sequential(nn.Dropout()), torch.randn(2, 3))
        done.set()

    with lock:
        thread = threading.Thread(target=run)
        thread.start()
        waited = not done.wait(0.2)
    thread.join(10)
    assert waited and done.is_set()


@st.composite
def random_models(draw: st.DrawFn) -> tuple[nn.Sequential, int]:
    width = draw(st.integers(1, 6))
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["linear", "bn", "dropout", "relu", "relu_", "frozen"]))
        if kind == "linear":
            layers.append(nn.Linear(width, width))
        elif kind == "frozen":
            layers.append(nn.Linear(width, width).requires_grad_(False))
        elif kind == "bn":
            layers.append(nn.BatchNorm1d(width, momentum=draw(st.sampled_from([0.1, None]))))
        elif kind == "dropout":
            layers.append(nn.Dropout(draw(st.sampled_from([0.0, 0.5, 1.0]))))
        else:
            layers.append(nn.ReLU(inplace=kind == "relu_"))
    model = nn.Sequential(*layers)
    for parameter in model.parameters():
        if draw(st.booleans()):
            parameter.grad = torch.randn_like(parameter)
    for module in model:
        if draw(st.booleans()):
            module.eval()
    return model, width


@settings(max_examples=40, deadline=None)
@given(random_models(), st.integers(0, 2**16), st.booleans())
def test_random_models_leave_no_trace(
    case: tuple[nn.Sequential, int], seed: int, input_grad: bool
) -> None:
    model, width = case
    torch.manual_seed(seed)
    sample = torch.randn(4, width, requires_grad=input_grad)
    before = snapshot(model)
    times = profile_times(model, sample, timeout=0)
    sizes = profile_sizes(model, sample, chunks=2)
    assert len(times) == len(sizes) == len(model)
    assert all(t >= 0 for t in times) and all(s >= 0 for s in sizes)
    assert_unchanged(model, before)
    assert sample.grad is None


def test_an_error_in_a_layer_leaves_no_trace() -> None:
    class Fails(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.rand(3)  # moves the generator before failing
            raise RuntimeError("layer failed")

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(), Fails())
    sample = torch.randn(3, 4)
    before = snapshot(model)
    for profile in (profile_times, profile_sizes):
        with pytest.raises(RuntimeError, match="layer failed"):
            profile(model, sample)
        assert_unchanged(model, before)
    assert torch.is_grad_enabled()


def test_grad_mode_is_restored_and_not_needed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad():
        sizes = profile_sizes(model, torch.randn(2, 4), param_scale=0)
        assert not torch.is_grad_enabled()
    assert sizes == [32.0, 32.0]


# --------------------------------------------------------------------------------------------
# What the profilers measure
# --------------------------------------------------------------------------------------------


def test_sizes_count_saved_activations_and_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    # Linear saves its input; ReLU saves its output; the next Linear saves that same output
    # as its input, which counts once, for the ReLU.
    assert profile_sizes(model, x, param_scale=0) == [5 * 8 * 4, 5 * 16 * 4, 0]
    weights = [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]
    with_params = profile_sizes(model, x, param_scale=2.5)
    assert with_params == [a + 2.5 * w for a, w in zip([160, 320, 0], weights)]


def test_balance_by_size_isolates_the_heavy_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 8))
    x = torch.randn(4, 8)
    # Saved inputs plus parameters times 2 (4-byte floats).
    expected = [128 + 2 * 288, 128 + 2 * 288, 128 + 2 * 18432, 8192 + 2 * 16416]
    assert profile_sizes(model, x) == expected
    assert balance_by_size(2, model, x) == [3, 1]  # the uniform [2, 2] would be 78016 bytes
    assert balance_by_size(3, model, x) == [2, 1, 1]


def test_sizes_count_a_storage_once_through_views() -> None:
    class HalvesProduct(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x[:, :4] * x[:, 4:]  # mul saves both halves: two views of one storage

    class Square(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * x

    x = torch.randn(3, 8, requires_grad=True)
    assert profile_sizes(nn.Sequential(HalvesProduct()), x) == [3 * 8 * 4]
    assert profile_sizes(nn.Sequential(Square()), x) == [3 * 8 * 4]


def test_sizes_count_buffers_once() -> None:
    model = nn.Sequential(nn.BatchNorm1d(4, affine=False))
    x = torch.randn(6, 4, requires_grad=True)
    sizes = profile_sizes(model, x, param_scale=10.0)
    # running_mean, running_var (4 floats each), num_batches_tracked (one int64); the
    # saved activations are the input and the per-feature statistics.
    buffers = 4 * 4 * 2 + 8
    assert sizes[0] >= buffers + 6 * 4 * 4
    no_buffers = nn.Sequential(nn.BatchNorm1d(4, affine=False, track_running_stats=False))
    assert sizes[0] - profile_sizes(no_buffers, x)[0] == buffers
    # Nothing requires a gradient: autograd saves nothing, and only the buffers count.
    assert profile_sizes(model, x.detach()) == [buffers]


def test_sizes_profile_one_micro_batch() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    whole = profile_sizes(model, torch.randn(8, 4), param_scale=0)
    assert profile_sizes(model, torch.randn(8, 4), chunks=2, param_scale=0) == [
        s / 2 for s in whole
    ]
    # Uneven chunks: the first, largest micro-batch (3 of 7 rows) is profiled.
    assert profile_sizes(model, torch.randn(7, 4), chunks=3, param_scale=0) == [48.0, 48.0]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock profile_times reads, made fake: layers advance it instead of sleeping, so
    the measured times are exact and do not depend on the load of the machine."""
    now = [0.0]
    monkeypatch.setattr(profile_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def takes(clock: list[float], *seconds: float) -> nn.Sequential:
    """A model whose layer ``i`` takes ``seconds[i]`` on ``clock`` in its forward."""

    class Takes(nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x: Tensor) -> Tensor:
            clock[0] += self.seconds
            return x + 1

    return nn.Sequential(*[Takes(s) for s in seconds])


def test_time_finds_the_slow_layer(clock: list[float]) -> None:
    model = takes(clock, 1.0, 1.0, 30.0, 1.0, 1.0)
    sample = torch.randn(2, 4)
    assert profile_times(model, sample, timeout=0) == [1.0, 1.0, 30.0, 1.0, 1.0]
    # The slow layer alone is the only split with the smallest bottleneck.
    assert balance_by_time(3, model, sample, timeout=0) == [2, 1, 2]


def test_time_repeats_until_the_timeout(clock: list[float]) -> None:
    calls = []

    class Count(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            calls.append(clock[0])
            clock[0] += 1.0
            return x * 2

    profile_times(nn.Sequential(Count()), torch.randn(2, 2), timeout=8.0)
    # The warm-up pass and the 5 minimum passes end at 6 s; passes start until 8 s.
    assert calls == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_time_is_the_median_of_the_passes(clock: list[float]) -> None:
    # The warm-up pass, then seven measured passes: the 5 minimum ones end at 307 s.
    seconds = iter([0.0, 2.0, 100.0, 2.0, 3.0, 200.0, 1.0, 2.0])

    class Hiccup(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            clock[0] += next(seconds)
            return x + 1

    assert profile_times(nn.Sequential(Hiccup()), torch.randn(2, 2), timeout=309.0) == [2.0]


def test_time_includes_backward(clock: list[float]) -> None:
    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            clock[0] += 30.0
            return grad

    class Layer(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return SlowBackward.apply(x)

    model = nn.Sequential(nn.Linear(4, 4), Layer(), nn.Linear(4, 4))
    assert profile_times(model, torch.randn(2, 4), timeout=0) == [0.0, 30.0, 0.0]


def test_inplace_layers() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    sample = torch.randn(3, 4)
    before = sample.clone()
    assert len(profile_times(model, sample, timeout=0)) == 3
    assert len(profile_sizes(model, sample)) == 3
    assert torch.equal(sample, before)
    leaf = torch.randn(3, 4, requires_grad=True)
    profile_times(model, leaf, timeout=0)
    assert leaf.grad is None


def test_tuples_and_outputs_without_grad() -> None:
    class Split(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return x[:, :2], x[:, 2:]

    class Join(nn.Module):
        def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
            return torch.cat(xs, dim=1)

    class ArgMax(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.argmax(dim=1)

    model = nn.Sequential(nn.Linear(4, 4), Split(), Join(), ArgMax())
    assert len(profile_times(model, torch.randn(3, 4), timeout=0)) == 4
    assert len(profile_sizes(model, torch.randn(3, 4))) == 4
    # A tuple that the first layer takes as one argument goes in a one-element tuple.
    first = nn.Sequential(Join(), nn.Linear(4, 4))
    pair = (torch.randn(3, 2), torch.randn(3, 2))
    assert len(profile_times(first, (pair,), timeout=0)) == 2
    assert balance_by_size(2, first, (pair,), chunks=3) == [1, 1]


def test_tuple_subclasses_reach_the_layers_with_their_type() -> None:
    # torch.return_types.max between layers, and a namedtuple as the sample.
    class ToMax(nn.Module):
        def forward(self, x: Tensor) -> Any:
            return torch.stack([x, -x], dim=2).max(dim=2)

    class FromMax(nn.Module):
        def forward(self, result: Any) -> Tensor:
            return result.values * result.indices

    model = nn.Sequential(nn.Linear(4, 4), ToMax(), FromMax())
    assert len(profile_times(model, torch.randn(3, 4), timeout=0)) == 3
    assert len(profile_sizes(model, torch.randn(3, 4))) == 3
    sample = torch.randn(3, 4).max(dim=1)
    first = nn.Sequential(FromMax(), nn.Linear(3, 3))
    assert len(profile_times(first, (sample,), timeout=0)) == 2
    assert len(profile_sizes(first, (sample,))) == 2


# A skip connection kept in thread-local state, the way skippable layers work outside a
# pipeline; the namespace object is compared by identity.
_stash = threading.local()


class Namespace:
    pass


class Stash(nn.Module):
    def __init__(self, namespace: Namespace) -> None:
        super().__init__()
        self.namespace = namespace
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        _stash.__dict__[self.namespace] = y.relu()
        return y


class Pop(nn.Module):
    def __init__(self, namespace: Namespace) -> None:
        super().__init__()
        self.namespace = namespace

    def forward(self, x: Tensor) -> Tensor:
        return x + _stash.__dict__.pop(self.namespace)


def test_layers_sharing_thread_local_state() -> None:
    namespace = Namespace()
    model = nn.Sequential(Stash(namespace), nn.Linear(4, 4), nn.Tanh(), Pop(namespace))
    sample = torch.randn(3, 4)
    before = snapshot(model)
    assert len(profile_times(model, sample, timeout=0)) == 4
    assert len(profile_sizes(model, sample)) == 4
    assert balance_by_time(2, model, sample, timeout=0) in ([1, 3], [2, 2], [3, 1])
    assert not _stash.__dict__
    assert_unchanged(model, before)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class Recorder(nn.Module):
    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        Recorder.calls += 1
        return x


BALANCERS = {
    "balance_by_time": lambda p, m, x, **kw: balance_by_time(p, m, x, timeout=0, **kw),
    "balance_by_size": lambda p, m, x, **kw: balance_by_size(p, m, x, **kw),
}


@pytest.mark.parametrize("balancer", list(BALANCERS))
def test_partitions_errors_before_profiling(balancer: str) -> None:
    model = nn.Sequential(Recorder(), Recorder())
    Recorder.calls = 0
    with pytest.raises(
        BalanceError,
        match=r"partitions must not exceed the number of layers \(partitions: 3, layers: 2\)",
    ):
        BALANCERS[balancer](3, model, torch.randn(2, 2))
    for bad in (0, -2):
        with pytest.raises(BalanceError, match=rf"positive integer \(partitions: {bad}\)"):
            BALANCERS[balancer](bad, model, torch.randn(2, 2))
    assert Recorder.calls == 0
    assert BALANCERS[balancer](2, model, torch.randn(2, 2)) == [1, 1]


@pytest.mark.parametrize("balancer", list(BALANCERS))
def test_not_sequential(balancer: str) -> None:
    with pytest.raises(TypeError, match=r"module must be nn.Sequential .*\(module: Linear\)"):
        BALANCERS[balancer](1, nn.Linear(2, 2), torch.randn(2, 2))
    with pytest.raises(TypeError, match=r"\(module: ModuleList\)"):
        BALANCERS[balancer](1, nn.ModuleList([nn.Linear(2, 2)]), torch.randn(2, 2))


@pytest.mark.parametrize("balancer", list(BALANCERS))
def test_sample_on_another_device(balancer: str) -> None:
    name = "sample" if balancer == "balance_by_time" else "input"
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=rf"{name} must be on the profiled device \({name}: cpu, device: meta\)"
    ):
        BALANCERS[balancer](1, model, torch.randn(2, 2), device="meta")
    with pytest.raises(ValueError, match=rf"{name} must be on one device"):
        pair = (torch.randn(2, 2), torch.randn(2, 2, device="meta"))
        BALANCERS[balancer](1, nn.Sequential(nn.Bilinear(2, 2, 2)), pair)
    # The matching device, named in any form, is accepted.
    assert BALANCERS[balancer](1, model, torch.randn(2, 2), device=torch.device("cpu")) == [1]
    assert BALANCERS[balancer](1, model, torch.randn(2, 2), device="cpu") == [1]
    assert BALANCERS[balancer](1, model, torch.randn(2, 2), device="cpu:0") == [1]


@pytest.mark.parametrize("balancer", list(BALANCERS))
def test_sample_on_cpu_profiled_on_cuda(balancer: str) -> None:
    # Named without an index, with or without CUDA on the machine: the same clear error.
    name = "sample" if balancer == "balance_by_time" else "input"
    model = nn.Sequential(nn.Linear(2, 2))
    for device in ("cuda", torch.device("cuda")):
        with pytest.raises(
            ValueError, match=rf"{name} must be on the profiled device \({name}: cpu, device: cuda"
        ):
            BALANCERS[balancer](1, model, torch.randn(2, 2), device=device)


@pytest.mark.parametrize("balancer", list(BALANCERS))
def test_sample_not_tensors(balancer: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    name = "sample" if balancer == "balance_by_time" else "input"
    with pytest.raises(
        TypeError, match=rf"{name} must be a tensor, a tuple or a dict: .*\({name}: list\)"
    ):
        BALANCERS[balancer](1, model, [torch.randn(2, 2)])
    with pytest.raises(TypeError, match=rf"{name} must hold a tensor, .*\({name}: tuple of 2"):
        BALANCERS[balancer](1, model, (1, None))
    with pytest.raises(TypeError, match=rf"{name} given as a mapping .*\({name} keys: \['0'\]"):
        BALANCERS[balancer](1, model, {0: torch.randn(2, 2)})


def test_layer_output_not_tensors() -> None:
    class Bad(nn.Module):
        def forward(self, x: Tensor) -> dict[str, object]:
            return {"x": x.shape}

    with pytest.raises(
        TypeError,
        match=r"output of layer 1 must be a tensor, or hold one .*\(output of layer 1: dict\)",
    ):
        profile_times(nn.Sequential(nn.Identity(), Bad()), torch.randn(2, 2), timeout=0)


def test_bad_numbers() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"timeout must be finite and non-negative \(timeout: -1"):
        profile_times(model, x, timeout=-1)
    with pytest.raises(ValueError, match=r"timeout must be finite .*\(timeout: inf\)"):
        profile_times(model, x, timeout=float("inf"))
    with pytest.raises(TypeError, match=r"timeout must be a real number \(timeout: '1'\)"):
        profile_times(model, x, timeout="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunks must be a positive integer \(chunks: 0\)"):
        profile_sizes(model, x, chunks=0)
    with pytest.raises(ValueError, match=r"param_scale must be finite .*\(param_scale: nan\)"):
        profile_sizes(model, x, param_scale=float("nan"))


def test_layer_that_cannot_be_copied() -> None:
    class Uncopyable(nn.Module):
        def __deepcopy__(self, memo: dict[int, Any]) -> Uncopyable:
            raise RuntimeError("no copies")

    with pytest.raises(TypeError, match=r"layer 1 \(Uncopyable\) cannot be copied"):
        profile_sizes(nn.Sequential(nn.Identity(), Uncopyable()), torch.randn(2, 2))


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_cuda_profiles_leave_no_trace() -> None:
    torch.manual_seed(0)
    model = bn_dropout_model()
    sample = torch.randn(10, 6)
    before = snapshot(model)
    cuda_rng = torch.cuda.get_rng_state()
    sizes = profile_sizes(model, sample.cuda(), chunks=2)
    times = profile_times(model, sample.cuda(), timeout=0.05)
    assert len(sizes) == len(times) == len(model)
    assert all(t > 0 for t in times) and all(s > 0 for s in sizes[:2])
    assert len(balance_by_time(3, model, sample.cuda(), device="cuda", timeout=0)) == 3
    assert len(balance_by_size(3, model, sample.cuda(), device=0)) == 3
    assert_unchanged(model, before)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)


@pytest.mark.cuda
@needs_cuda
def test_cuda_sizes_match_cpu_sizes() -> None:
    # Linear and ReLU save the same tensors on every device; the count is exact on both.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    assert profile_sizes(model, x.cuda(), chunks=2) == profile_sizes(model, x, chunks=2)


@pytest.mark.cuda
@needs_cuda
def test_cuda_sample_on_another_device() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"sample must be on the profiled device \(sample: cpu"):
        balance_by_time(1, model, torch.randn(2, 2), device="cuda")
    with pytest.raises(ValueError, match=r"input: cuda:0, device: cpu"):
        balance_by_size(1, model, torch.randn(2, 2, device="cuda"), device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_profiled_device_is_the_current_device() -> None:
    class Noise(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            # On the current device, as a layer may do: in a pipeline, its partition's device.
            return x + torch.randn(x.shape, device="cuda")

    model = nn.Sequential(nn.Linear(4, 4), Noise())
    sample = torch.randn(2, 4, device="cuda:1")
    states = [torch.cuda.get_rng_state(index) for index in range(2)]
    assert torch.cuda.current_device() == 0
    assert len(profile_times(model, sample, timeout=0)) == 2
    assert len(profile_sizes(model, sample)) == 2
    assert torch.cuda.current_device() == 0
    for index, state in enumerate(states):
        assert torch.equal(torch.cuda.get_rng_state(index), state), index


def test_time_leaves_out_the_warm_up_pass(clock: list[float]) -> None:
    calls = []

    class SlowOnce(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            calls.append(1)
            if len(calls) == 1:
                clock[0] += 50.0  # a one-time cost, as lazy initialization is
            return x + 1

    model = nn.Sequential(SlowOnce(), nn.Linear(4, 4))
    times = profile_times(model, torch.randn(2, 4), timeout=0)
    assert len(calls) == 6  # the warm-up pass and the 5 minimum passes
    assert times == [0.0, 0.0]
