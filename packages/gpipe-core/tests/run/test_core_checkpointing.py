"""Checkpointing inside the pipeline: dropout masks replayed, phase flags seen by layers."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from core_support.models import MODES, Scale
from gpipe_checkpoint import is_checkpointing, is_recomputing
from gpipe_core import GPipe


class Nap(nn.Module):
    """An identity that sleeps a little, so other workers run meanwhile (no timing asserted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x


@pytest.fixture
def dropout_pipe() -> Callable[..., GPipe]:
    def make(partitions: int, chunks: int, checkpoint: str, nap: bool) -> GPipe:
        layers: list[nn.Module] = []
        for j in range(partitions):
            if nap:
                layers.append(Nap())
            layers += [nn.Dropout(0.5), Scale(1.5 + j)]
        per = len(layers) // partitions
        return GPipe(
            nn.Sequential(*layers), [per] * partitions, chunks=chunks, checkpoint=checkpoint
        )

    return make


@pytest.mark.parametrize("nap", [False, True], ids=["busy", "napping"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize(("partitions", "chunks"), [(2, 4), (3, 5), (4, 3)])
def test_dropout_gradient_matches_the_forward_masks(
    partitions: int, chunks: int, checkpoint: str, nap: bool, dropout_pipe: Callable[..., GPipe]
) -> None:
    # out = mask * x * c elementwise, so d(out.sum())/dx = out / x: the gradient must use
    # the very masks of the forward pass, although the checkpointed micro-batches recompute
    # them while other workers draw from the same generator.
    torch.manual_seed(partitions * 100 + chunks)
    pipe = dropout_pipe(partitions, chunks, checkpoint, nap)
    for _ in range(4):
        x = (torch.rand(4 * chunks, 32, dtype=torch.float64) + 0.5).requires_grad_()
        output = pipe(x)
        output.sum().backward()
        expected = output.detach() / x.detach()
        torch.testing.assert_close(x.grad, expected)
        # The masks do differ between micro-batches and runs: dropout really ran.
        assert 0 < (output == 0).sum() < output.numel()


def test_dropout_fresh_models_first_run(dropout_pipe: Callable[..., GPipe]) -> None:
    # A fresh model learns which partitions draw random numbers during its first run; the
    # masks must be replayed correctly in that run too.
    for seed in range(8):
        torch.manual_seed(seed)
        pipe = dropout_pipe(3, 4, "always", nap=seed % 2 == 0)
        x = (torch.rand(16, 16, dtype=torch.float64) + 0.5).requires_grad_()
        output = pipe(x)
        output.sum().backward()
        torch.testing.assert_close(x.grad, output.detach() / x.detach())


class LinearT(nn.Module):
    """(ids, h) -> (ids, linear(h)): the integer row ids ride along."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, h = pair
        return ids, self.linear(h)


class DropoutT(nn.Module):
    """(ids, h) -> (ids, dropout(h)), recording the mask of each forward row by row id."""

    def __init__(self, masks: dict[tuple[int, int], torch.Tensor], lock: threading.Lock) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.masks = masks
        self.lock = lock

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, h = pair
        ones = torch.ones_like(h)
        mask = self.dropout(ones)  # 0 or 2: the mask this call draws
        if not is_recomputing():
            with self.lock:
                for row, sample in enumerate(ids.tolist()):
                    self.masks[(id(self), sample)] = mask[row].detach().clone()
        return ids, h * mask


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_dropout_between_linear_layers_matches_replayed_masks(checkpoint: str) -> None:
    # The plain model, run with the masks the pipeline drew in forward, must give the
    # pipeline's output and gradients: the recomputation replayed the same masks.
    torch.manual_seed(0)
    masks: dict[tuple[int, int], torch.Tensor] = {}
    lock = threading.Lock()
    drops = [DropoutT(masks, lock) for _ in range(3)]
    model = nn.Sequential(
        LinearT(5), drops[0], LinearT(5), drops[1], LinearT(5), drops[2], LinearT(5)
    ).double()
    pipe = GPipe(model, [2, 2, 3], chunks=4, checkpoint=checkpoint)

    ids = torch.arange(12)
    x = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    _, output = pipe((ids, x))
    weight = torch.randn_like(output)
    (output * weight).sum().backward()
    got = [p.grad.clone() for p in pipe.parameters()]
    got_x = x.grad.clone()
    assert len(masks) == 3 * 12

    for p in pipe.parameters():
        p.grad = None
    x.grad = None
    h = x
    for layer in model:
        if isinstance(layer, DropoutT):
            h = h * torch.stack([masks[(id(layer), int(s))] for s in ids])
        else:
            h = layer.linear(h)
    torch.testing.assert_close(output, h)
    (h * weight).sum().backward()
    for g, p in zip(got, pipe.parameters()):
        torch.testing.assert_close(g, p.grad)
    torch.testing.assert_close(got_x, x.grad)


# -- is_checkpointing / is_recomputing --------------------------------------------------------


class PhaseProbe(nn.Module):
    """Records, per call, the phase flags and the micro-batch (read from column 0)."""

    def __init__(self, key: int, log: list[tuple[int, int, bool, bool]], lock: threading.Lock):
        super().__init__()
        self.key = key
        self.log = log
        self.lock = lock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.log.append((self.key, int(x[0, 0].item()), is_checkpointing(), is_recomputing()))
        return x


def probe_pipe(
    partitions: int, chunks: int, checkpoint: str
) -> tuple[GPipe, list[tuple[int, int, bool, bool]]]:
    log: list[tuple[int, int, bool, bool]] = []
    lock = threading.Lock()
    layers: list[nn.Module] = []
    for j in range(partitions):
        layers += [PhaseProbe(j, log, lock), nn.Identity()]
    pipe = GPipe(nn.Sequential(*layers), [2] * partitions, chunks=chunks, checkpoint=checkpoint)
    return pipe, log


def micro_batch_input(chunks: int, rows: int = 2) -> torch.Tensor:
    # Column 0 holds the micro-batch index of each row.
    x = torch.randn(chunks * rows, 3)
    x[:, 0] = torch.arange(chunks).repeat_interleave(rows).float()
    return x.requires_grad_()


@pytest.mark.parametrize("checkpoint", MODES)
def test_phase_flags_with_fewer_samples_than_chunks(checkpoint: str) -> None:
    # 3 samples and chunks=5 give 3 micro-batches: 'except_last' checkpoints 2 of them.
    pipe, log = probe_pipe(2, 5, checkpoint)
    output = pipe(micro_batch_input(3, rows=1))
    checkpointed = {"always": 3, "except_last": 2, "never": 0}[checkpoint]
    assert len(log) == 2 * 3
    assert sum(chk for _, _, chk, _ in log) == 2 * checkpointed
    log.clear()
    output.sum().backward()
    assert len(log) == 2 * checkpointed
    assert all(rec for _, _, _, rec in log)


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("checkpoint", MODES)
def test_phase_flags_seen_by_layers(checkpoint: str, partitions: int, chunks: int) -> None:
    pipe, log = probe_pipe(partitions, chunks, checkpoint)
    output = pipe(micro_batch_input(chunks))
    checkpointed = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]

    forward = list(log)
    assert len(forward) == partitions * chunks
    for key, i, chk, rec in forward:
        assert not rec
        assert chk == (i < checkpointed), (key, i, chk)
    log.clear()

    output.sum().backward()
    backward = list(log)
    assert len(backward) == partitions * checkpointed
    for _, i, chk, rec in backward:
        assert (chk, rec) == (False, True)
        assert i < checkpointed
    assert sorted((key, i) for key, i, _, _ in backward) == sorted(
        (j, i) for j in range(partitions) for i in range(checkpointed)
    )
    # Recomputations of one partition run from the last micro-batch back to the first.
    for j in range(partitions):
        order = [i for key, i, _, _ in backward if key == j]
        assert order == sorted(order, reverse=True)
    # The flags are thread-local and reset after each phase.
    assert not is_checkpointing() and not is_recomputing()


def test_except_last_probe_counts() -> None:
    m = 5
    pipe, log = probe_pipe(2, m, "except_last")
    pipe(micro_batch_input(m)).sum().backward()
    probe0 = [(chk, rec) for key, _, chk, rec in log if key == 0]
    assert probe0.count((True, False)) == m - 1
    assert probe0.count((False, True)) == m - 1
    assert probe0.count((False, False)) == 1
    assert len(probe0) == 2 * m - 1


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_no_phase_flags_in_eval_or_without_grad(checkpoint: str) -> None:
    pipe, log = probe_pipe(2, 3, checkpoint)
    x = micro_batch_input(3)
    with torch.no_grad():
        pipe(x)
    pipe.eval()
    output = pipe(x)
    output.sum().backward()
    assert len(log) == 2 * 2 * 3
    assert all((chk, rec) == (False, False) for _, _, chk, rec in log)


def test_recomputation_runs_the_partition_once_more_per_checkpointed_micro_batch() -> None:
    calls: list[str] = []
    lock = threading.Lock()

    class Count(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                calls.append(threading.current_thread().name)
            return x * 2

    pipe = GPipe(nn.Sequential(Count(), Count()), [1, 1], chunks=3, checkpoint="always")
    out = pipe(torch.randn(6, 2, requires_grad=True))
    # Forward runs on the workers, one per partition.
    assert len(calls) == 6
    assert set(calls) == {"gpipe-worker-0", "gpipe-worker-1"}
    calls.clear()
    out.sum().backward()
    assert len(calls) == 6


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_dropout_switched_on_after_the_first_run(
    checkpoint: str, dropout_pipe: Callable[..., GPipe]
) -> None:
    torch.manual_seed(0)
    pipe = dropout_pipe(3, 4, checkpoint, nap=True)
    dropouts = [layer for layer in pipe if isinstance(layer, nn.Dropout)]
    for layer in dropouts:
        layer.p = 0.0  # dropout with p=0 draws no random numbers
    x = (torch.rand(16, 16, dtype=torch.float64) + 0.5).requires_grad_()
    pipe(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 1.5 * 2.5 * 3.5))

    for layer in dropouts:
        layer.p = 0.5
    for _ in range(4):
        x = (torch.rand(16, 16, dtype=torch.float64) + 0.5).requires_grad_()
        output = pipe(x)
        output.sum().backward()
        assert 0 < (output == 0).sum() < output.numel()
        torch.testing.assert_close(x.grad, output.detach() / x.detach())


class DrawsWherePositive(nn.Module):
    """Multiplies by a fresh uniform mask the rows whose first feature is positive (and
    draws nothing for a micro-batch without such rows): its draws depend on its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[:, 0] > 0
        if not bool(rows.any()):
            return x * 1.0
        mask = torch.ones_like(x)
        mask[rows] = torch.rand_like(x[rows]) + 0.5
        return x * mask


def positive_in_second_half(rows: int, width: int) -> torch.Tensor:
    """Rows whose first feature is positive in the second half only (micro-batch 1 of 2)."""
    x = torch.rand(rows, width, dtype=torch.float64) + 0.5
    x[: rows // 2, 0] = -x[: rows // 2, 0]
    return x


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
@pytest.mark.parametrize("draws_in", [0, 1])
def test_draws_of_some_micro_batches_only_are_replayed(path: str, draws_in: int) -> None:
    # out = mask * x elementwise with the mask drawn in the forward pass, so
    # d(out.sum())/dx = out / x: micro-batch 1 draws (and micro-batch 0 does not, or the
    # other way round), so whether the partition draws cannot be learned from one of them.
    torch.manual_seed(draws_in)
    pipe = GPipe(nn.Sequential(DrawsWherePositive(), Nap()), [1, 1], chunks=2, checkpoint="always")
    for _ in range(3):
        x = positive_in_second_half(8, 4)
        if draws_in == 0:
            x = x.flip(0)
        x.requires_grad_()
        if path == "forward":
            output = pipe(x)
            output.sum().backward()
        else:
            outputs: dict[int, torch.Tensor] = {}

            def loss(
                out: torch.Tensor, rows: torch.Tensor, outputs: dict[int, torch.Tensor] = outputs
            ) -> torch.Tensor:
                outputs[int(rows[0])] = out.detach()  # the loss may run out of order
                return out.sum()

            pipe.step(x, torch.arange(8), loss, schedule=path, reduction="sum")
            output = torch.cat([outputs[row] for row in sorted(outputs)])
        assert x.grad is not None
        torch.testing.assert_close(x.grad, output.detach() / x.detach())
        drawn = output.detach() != x.detach()
        assert drawn[4:].any() if draws_in == 1 else drawn[:4].any()


class Hooked(nn.Module):
    """Registers a hook on an activation (``gated``: not in the checkpoint phase)."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gated = gated
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if not (self.gated and is_checkpointing()):
            h.register_hook(lambda grad: self.seen.append(grad.detach().clone()))
        return torch.tanh(h)


def run_hooked(pipe: GPipe, path: str, x: torch.Tensor) -> None:
    if path == "forward":
        pipe(x).sum().backward()
    else:
        pipe.step(x, torch.zeros(len(x)), lambda out, _: out.sum(), schedule=path, reduction="sum")


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
def test_a_hook_in_the_checkpoint_phase_is_refused_with_what_to_do(path: str) -> None:
    pipe = GPipe(nn.Sequential(Hooked(gated=False), nn.Linear(4, 4)), [1, 1], chunks=2)
    with pytest.raises(RuntimeError, match="checkpoint phase") as caught:
        run_hooked(pipe, path, torch.randn(4, 4))
    message = str(caught.value)
    assert "gpipe.is_checkpointing()" in message and "gpipe.is_recomputing()" in message
    assert "checkpoint='never'" in message


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_a_hook_gated_on_the_phase_sees_the_plain_gradients(path: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Hooked(gated=True), nn.Linear(4, 4))
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4)
    run_hooked(pipe, path, x)
    for micro in x.chunk(2):
        plain(micro).sum().backward()
    hooked, expected = pipe[0], plain[0]
    assert isinstance(hooked, Hooked) and isinstance(expected, Hooked)
    assert len(hooked.seen) == 2  # once per micro-batch, in the backward pass

    def key(grad: torch.Tensor) -> float:  # the micro-batches' order may differ
        return float(grad.sum())

    for got, want in zip(sorted(hooked.seen, key=key), sorted(expected.seen, key=key), strict=True):
        torch.testing.assert_close(got, want)
