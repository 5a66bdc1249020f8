"""DeferredBatchNorm on its own: outputs, running statistics, counting, errors."""

from __future__ import annotations

import copy
import pickle
import re
import sys
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe_bn import DeferredBatchNorm, convert_deferred_batch_norm, mini_batch
from gpipe_checkpoint import checkpoint, enable_recomputing

BATCH_NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
# An input shape (without the batch dimension) for each kind, 4 channels; (N, 4) inputs
# for BatchNorm1d are tested separately, as a micro-batch of one sample is refused there.
SHAPES = {1: (4, 3), 2: (4, 3, 2), 3: (4, 2, 2, 3)}


def pair(
    dim: int = 2, momentum: float | None = 0.1, affine: bool = True, chunks: int = 1
) -> tuple[nn.Module, DeferredBatchNorm]:
    """A float64 ``nn.BatchNorm{dim}d`` with random state, and a deferred copy of it."""
    reference = BATCH_NORMS[dim](4, momentum=momentum, affine=affine).double()
    with torch.no_grad():
        if affine:
            reference.weight.uniform_(0.5, 2.0)
            reference.bias.uniform_(-1.0, 1.0)
        reference.running_mean.uniform_(-1.0, 1.0)
        reference.running_var.uniform_(0.5, 2.0)
    deferred = convert_deferred_batch_norm(copy.deepcopy(reference), chunks)
    assert isinstance(deferred, DeferredBatchNorm)
    return reference, deferred


def batch(size: int, dim: int = 2) -> torch.Tensor:
    # Far from zero mean, with a spread: a naive sum of squares would lose digits here.
    return torch.randn(size, *SHAPES[dim], dtype=torch.float64) * 3.0 + 50.0


def assert_same_statistics(deferred: nn.Module, reference: nn.Module) -> None:
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(
            getattr(deferred, name), getattr(reference, name), rtol=1e-7, atol=1e-12, msg=name
        )
    assert int(deferred.num_batches_tracked) == int(reference.num_batches_tracked)


# -- the running statistics equal those of the whole mini-batch -------------------------------


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_statistics_of_whole_mini_batches(
    dim: int, momentum: float | None, affine: bool, chunks: int
) -> None:
    torch.manual_seed(dim * 100 + chunks)
    reference, deferred = pair(dim, momentum, affine)
    for size in (16, 13, 9):  # uneven last micro-batches too
        x = batch(size, dim)
        reference(x)
        with mini_batch(deferred):
            for micro_batch in x.chunk(chunks):
                deferred(micro_batch)
        assert deferred.pending == 0
        assert_same_statistics(deferred, reference)


@pytest.mark.parametrize("momentum", [0.3, None])
def test_chunks_commits_without_a_context(momentum: float | None) -> None:
    torch.manual_seed(1)
    reference, deferred = pair(2, momentum, chunks=3)
    for _ in range(2):
        x = batch(12)
        reference(x)
        for count, micro_batch in enumerate(x.chunk(3), start=1):
            assert deferred.pending == count - 1
            deferred(micro_batch)
        assert deferred.pending == 0
        assert_same_statistics(deferred, reference)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    momentum=st.sampled_from([0.1, 0.5, 1.0, None]),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-1e4, 1e4),
    mini_batches=st.integers(1, 3),
)
def test_any_split_gives_the_whole_mini_batch_statistics(
    sizes: list[int], momentum: float | None, scale: float, shift: float, mini_batches: int
) -> None:
    torch.manual_seed(len(sizes))
    reference, deferred = pair(2, momentum)
    for _ in range(mini_batches):
        x = batch(sum(sizes)) * scale + shift
        reference(x)
        with mini_batch(deferred):
            for micro_batch in x.split(sizes):
                deferred(micro_batch)
        assert_same_statistics(deferred, reference)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("affine", [True, False])
def test_outputs_and_gradients_are_those_of_batch_norm(dim: int, affine: bool) -> None:
    torch.manual_seed(2)
    reference, deferred = pair(dim, affine=affine)
    x = batch(10, dim)
    with mini_batch(deferred):
        for micro_batch in x.chunk(3):
            a = micro_batch.clone().requires_grad_()
            b = micro_batch.clone().requires_grad_()
            expected, output = reference(a), deferred(b)
            torch.testing.assert_close(output, expected, rtol=0, atol=0)
            weight = torch.randn_like(expected)
            (expected * weight).sum().backward()
            (output * weight).sum().backward()
            torch.testing.assert_close(b.grad, a.grad)
    if affine:
        torch.testing.assert_close(deferred.weight.grad, reference.weight.grad)
        torch.testing.assert_close(deferred.bias.grad, reference.bias.grad)


def test_two_dimensional_input() -> None:
    torch.manual_seed(13)
    reference, deferred = pair(1, momentum=None)
    for size in (16, 12):
        x = torch.randn(size, 4, dtype=torch.float64) * 2.0 - 30.0
        reference(x)
        with mini_batch(deferred):
            for micro_batch in x.chunk(4):
                assert deferred(micro_batch).shape == micro_batch.shape
        assert_same_statistics(deferred, reference)


def test_float32_statistics() -> None:
    torch.manual_seed(3)
    reference = nn.BatchNorm2d(4)
    deferred = convert_deferred_batch_norm(copy.deepcopy(reference))
    x = torch.randn(16, 4, 5, 5) + 10.0
    reference(x)
    with mini_batch(deferred):
        for micro_batch in x.chunk(4):
            deferred(micro_batch)
    assert deferred.running_mean.dtype == torch.float32
    torch.testing.assert_close(deferred.running_mean, reference.running_mean)
    torch.testing.assert_close(deferred.running_var, reference.running_var)


def test_bfloat16_statistics() -> None:
    # Merged and updated in float32, stored in bfloat16.
    torch.manual_seed(14)
    reference = nn.BatchNorm2d(4, momentum=None).bfloat16()
    deferred = convert_deferred_batch_norm(copy.deepcopy(reference))
    x = (torch.randn(16, 4, 5, 5) * 2.0 + 3.0).bfloat16()
    reference(x)
    with mini_batch(deferred):
        for micro_batch in x.chunk(4):
            deferred(micro_batch)
    assert deferred.running_var.dtype == torch.bfloat16
    exact = x.double().transpose(0, 1).flatten(1)
    torch.testing.assert_close(deferred.running_mean.double(), exact.mean(1), rtol=1e-2, atol=0)
    torch.testing.assert_close(deferred.running_var.double(), exact.var(1), rtol=1e-2, atol=0)
    torch.testing.assert_close(deferred.running_var, reference.running_var, rtol=2e-2, atol=0)


# -- eval mode, no running statistics ---------------------------------------------------------


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_eval_uses_the_running_statistics(dim: int) -> None:
    torch.manual_seed(4)
    reference, deferred = pair(dim, chunks=2)
    reference.eval()
    deferred.eval()
    x = batch(6, dim)
    torch.testing.assert_close(deferred(x), reference(x), rtol=0, atol=0)
    # Nothing is counted or updated in eval mode.
    assert deferred.pending == 0
    assert_same_statistics(deferred, reference)
    assert int(deferred.num_batches_tracked) == 0


@pytest.mark.parametrize("training", [True, False])
def test_without_running_statistics(training: bool) -> None:
    torch.manual_seed(5)
    reference = nn.BatchNorm2d(4, track_running_stats=False).double().train(training)
    deferred = convert_deferred_batch_norm(copy.deepcopy(reference), chunks=2)
    assert isinstance(deferred, DeferredBatchNorm)
    assert deferred.running_mean is None and deferred.num_batches_tracked is None
    x = batch(6)
    with mini_batch(deferred):
        for micro_batch in x.chunk(2):
            torch.testing.assert_close(deferred(micro_batch), reference(micro_batch))
    assert deferred.pending == 0
    assert deferred.running_mean is None
    assert deferred.state_dict().keys() == reference.state_dict().keys()


def test_state_dicts_load_both_ways() -> None:
    torch.manual_seed(6)
    reference, deferred = pair(2, chunks=2)
    with mini_batch(deferred):
        for micro_batch in batch(8).chunk(2):
            deferred(micro_batch)
    assert deferred.state_dict().keys() == reference.state_dict().keys()
    reference.load_state_dict(deferred.state_dict())
    assert_same_statistics(deferred, reference)
    fresh = DeferredBatchNorm(4, dtype=torch.float64, dim=2)
    fresh.load_state_dict(reference.state_dict())
    assert_same_statistics(fresh, reference)


# -- recomputation is not counted --------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 3])
def test_checkpointed_micro_batches_count_once(chunks: int) -> None:
    torch.manual_seed(7)
    reference, deferred = pair(2, momentum=None)
    block = nn.Sequential(nn.Conv2d(4, 4, 1).double(), deferred)
    plain = nn.Sequential(copy.deepcopy(block[0]), reference)
    for _ in range(2):
        x = batch(9)
        plain(x).sum().backward()
        with mini_batch(block):
            for micro_batch in x.chunk(chunks):
                checkpoint(block, micro_batch.requires_grad_()).sum().backward()
        # The recomputations ran in backward, inside the context, and counted nothing.
        assert_same_statistics(deferred, reference)
    torch.testing.assert_close(block[0].weight.grad, plain[0].weight.grad)


def test_recomputing_counts_nothing() -> None:
    deferred = DeferredBatchNorm(4, chunks=1)
    with enable_recomputing():
        output = deferred(torch.randn(5, 4))
    assert output.shape == (5, 4)
    assert deferred.pending == 0
    assert int(deferred.num_batches_tracked) == 0
    assert torch.equal(deferred.running_mean, torch.zeros(4))


# -- the mini_batch context --------------------------------------------------------------------


def test_an_error_in_the_body_drops_the_mini_batch() -> None:
    torch.manual_seed(8)
    reference, deferred = pair(2, chunks=2)
    x = batch(8)
    with pytest.raises(KeyError), mini_batch(deferred):
        deferred(x[:4])
        raise KeyError("boom")
    assert deferred.pending == 0
    assert_same_statistics(deferred, reference)  # as they were
    # The next mini-batch is counted alone.
    reference(x)
    with mini_batch(deferred):
        for micro_batch in x.chunk(3):
            deferred(micro_batch)
    assert_same_statistics(deferred, reference)


def test_leftovers_before_a_context_are_dropped() -> None:
    torch.manual_seed(9)
    reference, deferred = pair(2, chunks=4)
    deferred(batch(4))  # 1 of 4, never finished
    assert deferred.pending == 1
    x = batch(8)
    reference(x)
    with mini_batch(deferred):
        assert deferred.pending == 0
        for micro_batch in x.chunk(2):
            deferred(micro_batch)
    assert_same_statistics(deferred, reference)


def test_contexts_nest_and_the_outermost_commits() -> None:
    torch.manual_seed(10)
    reference, deferred = pair(2, chunks=1)
    model = nn.Sequential(deferred)
    x = batch(12)
    reference(x)
    with mini_batch(model):
        for half in x.chunk(2):
            with mini_batch(model):  # what a pipeline does on each call
                for micro_batch in half.chunk(3):
                    model(micro_batch)
            assert int(deferred.num_batches_tracked) == 0
    assert_same_statistics(deferred, reference)


def test_threads_sharing_a_layer_lose_no_micro_batch() -> None:
    # A layer shared by two pipeline partitions runs in two worker threads at once; an
    # unguarded merge loses micro-batches now and then, so try a few mini-batches.
    torch.manual_seed(15)
    reference = nn.BatchNorm1d(4096, momentum=1.0).double()
    deferred = convert_deferred_batch_norm(copy.deepcopy(reference))

    def feed(barrier: threading.Barrier, micro_batches: list[torch.Tensor]) -> None:
        barrier.wait()
        for micro_batch in micro_batches:
            deferred(micro_batch)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for _ in range(3):
            inputs = [torch.randn(2, 4096, dtype=torch.float64) * 3.0 + 50.0 for _ in range(400)]
            barrier = threading.Barrier(2)
            with mini_batch(deferred):
                threads = [
                    threading.Thread(target=feed, args=(barrier, inputs[i::2])) for i in range(2)
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            reference(torch.cat(inputs))
            assert_same_statistics(deferred, reference)
    finally:
        sys.setswitchinterval(interval)


def test_a_failed_update_leaves_the_other_layers_usable() -> None:
    # An update that raises on exit (an interrupt, say) must not leave the layers after
    # it held by a context that is gone: they would never update again.
    torch.manual_seed(16)
    first, second = DeferredBatchNorm(4), DeferredBatchNorm(4)
    model = nn.Sequential(first, second)

    def fail() -> None:
        raise KeyboardInterrupt

    first.commit = fail  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), mini_batch(model):
        model(torch.randn(6, 4))
    del first.commit
    with mini_batch(model):
        model(torch.randn(6, 4))
    assert int(first.num_batches_tracked) == 1
    assert int(second.num_batches_tracked) == 1


def test_an_empty_context_changes_nothing() -> None:
    deferred = DeferredBatchNorm(4)
    with mini_batch(deferred):
        pass
    deferred.eval()
    with mini_batch(deferred):
        deferred(torch.randn(3, 4))
    assert int(deferred.num_batches_tracked) == 0


@pytest.mark.parametrize("momentum", [0.1, None])
def test_an_empty_mini_batch_is_counted_and_changes_no_statistics(momentum: float | None) -> None:
    # nn.BatchNorm takes an empty batch in training: one more batch tracked, nothing else.
    torch.manual_seed(17)
    reference, deferred = pair(2, momentum=momentum)
    empty = batch(0)
    reference(empty)
    with mini_batch(deferred):
        deferred(empty)
        deferred(empty)
    assert_same_statistics(deferred, reference)
    x = batch(6)
    reference(x)
    with mini_batch(deferred):
        deferred(empty)
        deferred(x)
    assert_same_statistics(deferred, reference)


def test_discard() -> None:
    torch.manual_seed(11)
    reference, deferred = pair(2, chunks=3)
    deferred(batch(4))
    deferred.discard()
    assert deferred.pending == 0
    x = batch(9)
    reference(x)
    for micro_batch in x.chunk(3):
        deferred(micro_batch)
    assert_same_statistics(deferred, reference)


def test_copies_start_afresh() -> None:
    deferred = DeferredBatchNorm(4, chunks=2)
    with mini_batch(deferred):
        deferred(torch.randn(3, 4))
        for clone in (copy.deepcopy(deferred), pickle.loads(pickle.dumps(deferred))):
            assert clone.pending == 0
            # The copy is in no context: it commits after its own 2 micro-batches.
            clone(torch.randn(3, 4))
            clone(torch.randn(3, 4))
            assert int(clone.num_batches_tracked) == 1
        assert deferred.pending == 1
    assert int(deferred.num_batches_tracked) == 1


def test_moved_between_dtypes_while_pending() -> None:
    torch.manual_seed(12)
    deferred = DeferredBatchNorm(4, chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    deferred(x[:3].float())
    deferred.double()
    deferred(x[3:])
    assert deferred.running_mean.dtype == torch.float64
    torch.testing.assert_close(deferred.running_mean, 0.1 * x.mean(0), rtol=1e-6, atol=1e-7)


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [0, -2, 1.5, True, None, "2"])
def test_bad_chunks(chunks: object) -> None:
    message = f"chunks must be a positive integer (chunks: {chunks!r})"
    with pytest.raises(ValueError, match=re.escape(message)):
        DeferredBatchNorm(4, chunks=chunks)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -2, 1.5, True, None])
def test_bad_chunks_set_later(chunks: object) -> None:
    # chunks may be changed at any time; a bad value must not pass as "update every time".
    deferred = DeferredBatchNorm(4, chunks=3)
    message = f"chunks must be a positive integer (chunks: {chunks!r})"
    with pytest.raises(ValueError, match=re.escape(message)):
        deferred.chunks = chunks  # type: ignore[assignment]
    assert deferred.chunks == 3
    deferred.chunks = 2
    deferred(torch.randn(3, 4))
    deferred(torch.randn(3, 4))
    assert int(deferred.num_batches_tracked) == 1


@pytest.mark.parametrize("dim", [0, 4, True, "2"])
def test_bad_dim(dim: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"dim must be 1, 2, 3 or None (dim: {dim!r})")):
        DeferredBatchNorm(4, dim=dim)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dim", "shape", "message"),
    [
        (1, (2, 4, 3, 3), "expected 2D or 3D input (got 4D input)"),
        (2, (2, 4, 3), "expected 4D input (got 3D input)"),
        (3, (2, 4, 3, 3), "expected 5D input (got 4D input)"),
        (None, (4,), "expected at least 2D input (got 1D input)"),
    ],
)
def test_input_dimensions(dim: int | None, shape: tuple[int, ...], message: str) -> None:
    deferred = DeferredBatchNorm(4, dim=dim)
    with pytest.raises(ValueError, match=re.escape(message)):
        deferred(torch.randn(shape))
    assert deferred.pending == 0


def test_any_dimensions_without_dim() -> None:
    deferred = DeferredBatchNorm(4, chunks=4)
    for shape in [(2, 4), (2, 4, 3), (2, 4, 3, 3), (2, 4, 1, 2, 3, 1)]:
        assert deferred(torch.randn(shape)).shape == shape
    assert int(deferred.num_batches_tracked) == 1


def test_one_value_per_channel_is_refused_as_by_batch_norm() -> None:
    deferred = DeferredBatchNorm(4)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        deferred(torch.randn(1, 4))
    assert deferred.pending == 0


def test_mini_batch_needs_a_module() -> None:
    not_a_module: Any = [DeferredBatchNorm(4)]
    message = "module must be an nn.Module (module: list)"
    with pytest.raises(TypeError, match=re.escape(message)), mini_batch(not_a_module):
        pass


def test_repr() -> None:
    text = repr(DeferredBatchNorm(4, momentum=None, chunks=3, dim=1))
    assert text.startswith("DeferredBatchNorm(4, eps=1e-05, momentum=None, affine=True")
    assert text.endswith("chunks=3, dim=1)")
