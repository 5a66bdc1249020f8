"""Test clusters: ranks in processes of their own, running the cases of
``distributed_cases.py`` (the fixtures that make them are in ``conftest.py``)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from torch.distributed import TCPStore

# -- several processes ---------------------------------------------------------------------

#: The folder of the tests (this package's parent): on the ranks' path, as on the tests'.
TESTS = Path(__file__).resolve().parent.parent
CASES_FILE = Path(__file__).with_name("distributed_cases.py")


def load_cases() -> ModuleType:
    """``distributed_cases.py``, loaded by path under the name the ranks' pickles use, as
    the ranks run it (a script, not ``core_support.distributed_cases``)."""
    spec = importlib.util.spec_from_file_location("gpipe_core_distributed_cases", CASES_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickled classes of the cases resolve through it
    spec.loader.exec_module(module)
    return module


def meeting_store() -> TCPStore:
    """A store on 127.0.0.1 and a port of its own, hosted by the test's process, where a
    cluster's ranks meet (each opens it as a client: ``join_store`` in
    ``distributed_cases.py``)."""
    return TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip


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
        #: The ranks meet at this store, which holds its port from the start (a port picked
        #: free and then released could be taken by another run's ranks in between).
        self.store = meeting_store()
        port = self.store.port
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["GPIPE_STRICT_PAYLOADS"] = "1" if payloads == "strict" else "0"
        # The script imports core_support, as the tests do.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
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


#: The payload channels (see ``gpipe_core.transport._payloads``): tagged (tensors in the
#: header when they fit), and strict (each tensor a payload of its exact size, in the headers'
#: order, one tag: the protocol NCCL needs, on gloo).
PAYLOAD_MODES = ("tagged", "strict")


def tested_payload_modes() -> tuple[str, ...]:
    """The channels every test with a cluster runs on: ``GPIPE_TEST_PAYLOADS`` (comma-separated),
    both by default. nox's test cells set one each (``tagged`` with the first torch version,
    ``strict`` with the other), so that a CI run tests each channel once."""
    value = os.environ.get("GPIPE_TEST_PAYLOADS", ",".join(PAYLOAD_MODES))
    modes = tuple(mode.strip() for mode in value.split(",") if mode.strip())
    unknown = [mode for mode in modes if mode not in PAYLOAD_MODES]
    if not modes or unknown:
        raise pytest.UsageError(
            f"GPIPE_TEST_PAYLOADS={value!r}: expected a comma-separated list of {PAYLOAD_MODES}"
        )
    return modes
