"""Ranks in processes of their own: :func:`run` runs one case of :mod:`hf_support.cases` on
``world`` processes in one gloo group on ``127.0.0.1`` and returns their results; a rank
that raises or does not answer within ``timeout`` fails the call.

The processes of a world size are started by the first call and answer every later one
(importing torch and transformers takes most of a rank's start): each case starts as in a
fresh process (the default dtype float32, torch's first seed). A call that fails stops
them, so that the next one starts from new processes; :func:`close_all` (at the end of
the session) stops and reaps every one, and so does the ranks' end of input if the tests'
process dies.

Run as a script, it is one rank: ``ranks.py RANK WORLD PORT``, reading ``(case, kwargs)``
pickles on standard input and writing ``(ok, result or traceback)`` pickles on standard
output.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from torch.distributed import TCPStore

TESTS = Path(__file__).resolve().parent.parent


class RankFailed(AssertionError):
    """A rank raised, or did not answer in time."""


class _Ranks:
    """``world`` rank processes, answering one case after another."""

    def __init__(self, world: int) -> None:
        self.world = world
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
        self.folder = tempfile.TemporaryDirectory()
        self.logs = [Path(self.folder.name, f"rank{rank}.log") for rank in range(world)]
        # The ranks meet at a store that holds its port from the start (a port picked free
        # and then released could be taken by another run's ranks in between).
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
        port = self.store.port
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank, log in enumerate(self.logs):
            with log.open("wb") as stderr:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, __file__, str(rank), str(world), str(port)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        env=env,
                    )
                )

    def run(
        self, case: str, timeout: float, kwargs: dict[str, Any], strict: bool = True
    ) -> list[Any]:
        replies: list[Any] = [None] * self.world

        def ask(rank: int, process: subprocess.Popen[bytes]) -> None:
            assert process.stdin is not None and process.stdout is not None
            try:
                pickle.dump((case, kwargs), process.stdin)
                process.stdin.flush()
                replies[rank] = pickle.load(process.stdout)
            except (EOFError, OSError, pickle.UnpicklingError) as error:
                log = self.logs[rank].read_text(errors="replace")[-4000:]
                replies[rank] = (False, f"no answer ({type(error).__name__}: {error}):\n{log}")

        askers = [
            threading.Thread(target=ask, args=(rank, process), daemon=True)
            for rank, process in enumerate(self.processes)
        ]
        for asker in askers:
            asker.start()
        deadline = time.monotonic() + timeout
        for asker in askers:
            asker.join(max(0.0, deadline - time.monotonic()))
        late = [rank for rank, asker in enumerate(askers) if asker.is_alive()]
        if late:
            raise RankFailed(f"ranks {late} did not answer case {case} within {timeout} s")
        if not strict:
            return replies
        results = []
        for rank, (ok, value) in enumerate(replies):
            if not ok:
                raise RankFailed(f"rank {rank} of case {case} raised:\n{value}")
            results.append(value)
        return results

    def close(self) -> None:
        for process in self.processes:
            if process.stdin is not None:
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
        self.folder.cleanup()


_RANKS: dict[int, _Ranks] = {}


def run(case: str, world: int = 2, timeout: float = 240.0, **kwargs: Any) -> list[Any]:
    """Each rank's result of ``cases.<case>(rank, world, **kwargs)``."""
    ranks = _RANKS.get(world)
    if ranks is None:
        ranks = _RANKS[world] = _Ranks(world)
    try:
        return ranks.run(case, timeout, kwargs)
    except BaseException:
        # The ranks may be out of step (one waits in a collective): new ones next time.
        del _RANKS[world]
        ranks.close()
        raise


def replies(case: str, world: int = 2, timeout: float = 240.0, **kwargs: Any) -> list[Any]:
    """Each rank's ``(ok, result or traceback)`` of ``cases.<case>(rank, world, **kwargs)``,
    whether it raised or died (the ranks are stopped after it: one may be gone)."""
    ranks = _RANKS.pop(world, None) or _Ranks(world)
    try:
        return ranks.run(case, timeout, kwargs, strict=False)
    finally:
        ranks.close()


def close(world: int) -> None:
    """Stop and reap the rank processes of ``world`` ranks, if running."""
    ranks = _RANKS.pop(world, None)
    if ranks is not None:
        ranks.close()


def close_all() -> None:
    """Stop and reap every rank process."""
    while _RANKS:
        _RANKS.popitem()[1].close()


atexit.register(close_all)


def _main() -> None:
    rank, world, port = (int(arg) for arg in sys.argv[1:4])
    requests: IO[bytes] = sys.stdin.buffer
    replies: IO[bytes] = sys.stdout.buffer
    sys.stdout = sys.stderr  # prints must not mix with the replies
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    seed = torch.initial_seed()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    from hf_support import cases

    try:
        while True:
            try:
                case, kwargs = pickle.load(requests)
            except EOFError:
                break
            # As in a fresh process.
            torch.set_default_dtype(torch.float32)
            torch.manual_seed(seed)
            try:
                result: tuple[bool, Any] = (True, getattr(cases, case)(rank, world, **kwargs))
            except BaseException:
                result = (False, traceback.format_exc())
            pickle.dump(result, replies)
            replies.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
