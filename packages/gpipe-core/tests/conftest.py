"""Helpers shared by the gpipe-core tests, handed out as fixtures.

The tests run with ``--import-mode=importlib``, so a test module cannot import this file
by name: each fixture returns the helper (a function or a class) instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_core import GPipe


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an output: the tensor itself, or those of a tuple."""
    return list(value) if isinstance(value, tuple) else [value]


def _sum(output: Any) -> torch.Tensor:
    return output.sum()


def assert_matches_plain(
    pipe: GPipe,
    plain: nn.Module,
    x: Any,
    *,
    input_requires_grad: bool = True,
    feed: Callable[[torch.Tensor], Any] | None = None,
    loss: Callable[[Any], torch.Tensor] = _sum,
    weighted: bool = False,
    device: torch.device | str | None = None,
) -> tuple[Any, Any]:
    """Run ``pipe`` and ``plain`` on clones of ``x``, backward both, compare everything.

    Clears the parameters' grads first, so that only this run's are compared. Then checks:
    the outputs (and their ``requires_grad``), the grads of the inputs, and the grad of
    every parameter, which must exist. Returns ``(output, expected)`` for further checks.

    ``feed`` builds the model input from the cloned tensor (``(labels, x)`` for instance);
    ``loss`` maps an output to the scalar to backward (the sum by default); ``weighted``
    backwards the sum of the output times a random weight drawn after the forward pass;
    ``device`` is where both clones of ``x`` go (the plain model must be there too).
    """
    for module in (pipe, plain):
        for p in module.parameters():
            p.grad = None

    x = x.detach() if device is None else x.detach().to(device)
    x_plain = x.clone().requires_grad_(input_requires_grad)
    x_pipe = x.clone().requires_grad_(input_requires_grad)
    expected = plain(feed(x_plain) if feed else x_plain)
    output = pipe(feed(x_pipe) if feed else x_pipe)

    assert type(output) is type(expected)
    got, want = _tensors(output), _tensors(expected)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.to(w.device), w)
        assert g.requires_grad == w.requires_grad
    if not any(w.requires_grad for w in want):
        return output, expected  # a model without parameters, on an input without grad

    if weighted:
        weight = torch.randn_like(expected)
        (expected * weight).sum().backward()
        (output * weight.to(output.device)).sum().backward()
    else:
        loss(expected).backward()
        loss(output).backward()

    if input_requires_grad:
        assert x_pipe.grad is not None
        torch.testing.assert_close(x_pipe.grad.to(x_plain.device), x_plain.grad)
    else:
        assert x_pipe.grad is None and x_plain.grad is None
    pipe_params = list(pipe.named_parameters())
    plain_params = list(plain.parameters())
    assert len(pipe_params) == len(plain_params)
    for (name, p_pipe), p_plain in zip(pipe_params, plain_params):
        assert p_pipe.grad is not None, name
        assert p_pipe.grad.device == p_pipe.device, name
        torch.testing.assert_close(p_pipe.grad.to(p_plain.device), p_plain.grad, msg=name)
    return output, expected


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


# Session-scoped: they hand out stateless helpers, and Hypothesis refuses function-scoped
# fixtures in its tests.


@pytest.fixture(scope="session", name="assert_matches_plain")
def assert_matches_plain_fixture() -> Callable[..., tuple[Any, Any]]:
    """:func:`assert_matches_plain`: GPipe and the plain model give the same results."""
    return assert_matches_plain


@pytest.fixture(scope="session", name="Scale")
def scale_fixture() -> type[Scale]:
    """A module that multiplies its input by a constant factor."""
    return Scale


# -- several processes ---------------------------------------------------------------------

CASES_FILE = Path(__file__).with_name("distributed_cases.py")


def load_cases() -> ModuleType:
    """``distributed_cases.py``, loaded by path (the tests' modules are not a package)."""
    spec = importlib.util.spec_from_file_location("gpipe_core_distributed_cases", CASES_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickled classes of the cases resolve through it
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankFailed(AssertionError):
    """A rank of a test cluster raised, or did not answer in time."""


class Cluster:
    """``world`` processes in one gloo group, running the cases of ``distributed_cases.py``.

    Each rank is a subprocess (one intra-op thread) that answers on a pipe; :meth:`run`
    sends every rank a case and returns the ranks' results, or raises :class:`RankFailed`
    when one raised or did not answer within ``timeout`` seconds. :meth:`close` ends
    every process (killing it if it must) and reaps it. The ranks see no GPU unless
    ``gpus`` is true (for the tests marked ``cuda``), as every other test runs as on a
    machine without one. ``payloads`` is the payload channel the ranks' pipelines use on
    gloo (one of :data:`PAYLOAD_MODES`: ``GPIPE_STRICT_PAYLOADS`` in their environment).
    """

    def __init__(
        self, world: int, timeout: float = 120.0, *, gpus: bool = False, payloads: str = "tagged"
    ) -> None:
        assert payloads in PAYLOAD_MODES, payloads
        self.world = world
        self.timeout = timeout
        self.payloads = payloads
        self.cases = load_cases()
        port = _free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["GPIPE_STRICT_PAYLOADS"] = "1" if payloads == "strict" else "0"
        if not gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.processes = [
            subprocess.Popen(
                [sys.executable, str(CASES_FILE), str(rank), str(world), str(port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            for rank in range(world)
        ]

    def run(self, case: str, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``case`` on every rank with ``kwargs``; each rank's result."""
        replies: list[Any] = [None] * self.world

        def read(rank: int, process: subprocess.Popen[bytes]) -> None:
            assert process.stdin is not None and process.stdout is not None
            try:
                self.cases.write_frame(process.stdin, (case, kwargs))
                replies[rank] = self.cases.read_frame(process.stdout)
            except (EOFError, OSError) as error:
                replies[rank] = ("gone", f"{type(error).__name__}: {error}", "")

        readers = [
            threading.Thread(target=read, args=(rank, process), daemon=True)
            for rank, process in enumerate(self.processes)
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + (timeout or self.timeout)
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        late = [rank for rank, reader in enumerate(readers) if reader.is_alive()]
        if late:
            self.close()
            raise RankFailed(f"ranks {late} did not answer case {case!r} in time")
        return replies

    def results(self, case: str, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """:meth:`run`, refusing any rank's error."""
        replies = self.run(case, timeout, **kwargs)
        for rank, reply in enumerate(replies):
            if reply[0] != "ok":
                raise RankFailed(f"rank {rank}: {reply[1]}\n{reply[2]}")
        return [reply[1] for reply in replies]

    def close(self) -> None:
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:
                with contextlib.suppress(OSError):
                    process.stdin.close()
        deadline = time.monotonic() + 20
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


@pytest.fixture(scope="session", name="load_cases")
def load_cases_fixture() -> Callable[[], ModuleType]:
    return load_cases


#: The payload channels (see ``gpipe_core.transport._payloads``): tagged (tensors in the
#: header when they fit), and strict (each tensor a payload of its exact size, in the headers'
#: order, one tag: the protocol NCCL needs, on gloo).
PAYLOAD_MODES = ("tagged", "strict")


def _tested_payload_modes() -> tuple[str, ...]:
    """The channels every test with a cluster runs on: ``GPIPE_TEST_PAYLOADS`` (comma-separated),
    both by default. nox's second torch cell sets ``tagged`` only, so that the cluster tests do
    not run four times in a CI run."""
    value = os.environ.get("GPIPE_TEST_PAYLOADS", ",".join(PAYLOAD_MODES))
    modes = tuple(mode.strip() for mode in value.split(",") if mode.strip())
    unknown = [mode for mode in modes if mode not in PAYLOAD_MODES]
    if not modes or unknown:
        raise pytest.UsageError(
            f"GPIPE_TEST_PAYLOADS={value!r}: expected a comma-separated list of {PAYLOAD_MODES}"
        )
    return modes


@pytest.fixture(scope="module", name="payloads", params=_tested_payload_modes())
def payloads_fixture(request: pytest.FixtureRequest) -> str:
    """The payload channel of the clusters of a module's tests, one after the other (one
    fixture for every cluster fixture, so that a test with two clusters has both on one)."""
    return str(request.param)


@pytest.fixture(scope="module", name="cluster2")
def cluster2_fixture(payloads: str) -> Iterator[Cluster]:
    """Two ranks, shared by the tests of a module (each test's cases leave them ready),
    on each payload channel."""
    cluster = Cluster(2, payloads=payloads)
    try:
        yield cluster
    finally:
        cluster.close()


def _clusters(payloads: str) -> Iterator[Callable[[int], Cluster]]:
    made: list[Cluster] = []

    def make(world: int, *, gpus: bool = False) -> Cluster:
        made.append(Cluster(world, gpus=gpus, payloads=payloads))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture(name="new_cluster")
def new_cluster_fixture(payloads: str) -> Iterator[Callable[[int], Cluster]]:
    """Make clusters of a given size for one test, on each payload channel; they are
    closed after it."""
    yield from _clusters(payloads)


@pytest.fixture(scope="module", name="new_cluster_module")
def new_cluster_module_fixture(payloads: str) -> Iterator[Callable[[int], Cluster]]:
    """Make clusters of a given size for a test module, on each payload channel; they are
    closed after it."""
    yield from _clusters(payloads)
