"""Local ranks: start a command in several processes of one gloo group, and reap them.

:func:`launch` runs the same command as ranks ``0 .. n-1`` on this host, with the
environment ``torchrun`` gives its processes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port), one
intra-op thread each (``OMP_NUM_THREADS=1``). A rank tells what it raised through the
file named by ``GPIPE_RANK_ERROR_FILE`` (see :func:`report_error`), and ends itself when
the launcher is gone (see :func:`watch_launcher`).

Every process it starts is reaped before it returns, whatever happens: when a rank fails,
the others have ``grace`` seconds to end (they are told of the failure by the pipeline),
then they are terminated, then killed; on ``KeyboardInterrupt`` (Ctrl-C) or ``SIGTERM`` all of
them are stopped at once.

Why not torch's elastic launch (``torch.distributed.launcher.api.elastic_launch``, what
``torchrun`` runs) for starting, watching and reaping the ranks: read against torch 2.13's
``launch_agent`` and ``LocalElasticAgent``, it lacks what this launcher is for.

- **The failing rank's error first.** The agent stops every other rank (``SIGTERM``) as soon
  as it sees one exit with an error. A rank told of another's failure
  (``RemoteStageError``) often exits before the rank that failed has written its error, which
  then dies without it, and the run would report the told rank. This launcher gives the
  others ``grace`` seconds and prefers a rank's own error.
- **Ranks end with their launcher.** The agent starts its workers in sessions of their own
  (``start_new_session=True``) with nothing that ends them when it dies: a ``SIGKILL`` of
  the agent leaves them running. Here each rank watches the pipe of its standard input
  (:func:`watch_launcher`).
- **The environment of the ranks** (``env``): the agent passes its own process's.

It would give: the rendezvous store, and with it no race for ``MASTER_PORT`` (the retries
here), and the error files of ``torch.distributed.elastic.multiprocessing.errors.record``.
Moving to it is left open (issue 24) until the first point has an answer in the ranks, such
as a told rank waiting ``grace`` seconds before it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gpipe_core import RemoteStageError

__all__ = [
    "ERROR_FILE",
    "WATCH_LAUNCHER",
    "RankError",
    "free_port",
    "launch",
    "report_error",
    "watch_launcher",
]

#: The environment variable naming the file a rank writes its error to.
ERROR_FILE = "GPIPE_RANK_ERROR_FILE"
#: Set (to ``1``) for ranks whose standard input is a pipe from the launcher.
WATCH_LAUNCHER = "GPIPE_WATCH_LAUNCHER"
#: How often the launcher looks at its ranks, in seconds.
_POLL = 0.05
#: How long a terminated rank has to exit before it is killed, in seconds.
_TERMINATE_WAIT = 5.0
#: How many times the ranks start, each with another free port, while the first rank finds
#: its port taken (by another program, between the launcher's choice and the rank's listen).
_PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the first rank listens on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RankError:
    """What a rank reported it raised."""

    rank: int
    type: str
    message: str
    traceback: str
    #: Whether it is another rank's failure, told to this one (``RemoteStageError``).
    remote: bool


def report_error(error: BaseException, rank: int, path: str | os.PathLike[str]) -> None:
    """Write ``error`` (raised on ``rank``) to ``path``, for the launcher."""
    remote = isinstance(error, RemoteStageError)
    record = {
        "rank": rank,
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
        "remote": remote,
    }
    Path(path).write_text(json.dumps(record), encoding="utf-8")


def _read_error(path: Path) -> RankError | None:
    try:
        record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return RankError(
            rank=int(record["rank"]),
            type=str(record["type"]),
            message=str(record["message"]),
            traceback=str(record["traceback"]),
            remote=bool(record["remote"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def watch_launcher() -> None:
    """In a rank started by :func:`launch`: exit at once if the launcher goes away.

    The launcher holds the write end of the rank's standard input; its end (even by
    ``SIGKILL``) closes it, and the read here returns. Nothing is done without
    ``GPIPE_WATCH_LAUNCHER`` in the environment (under ``torchrun``, for one).
    """
    if os.environ.get(WATCH_LAUNCHER) != "1":
        return

    def watch() -> None:
        # The raw descriptor: a thread blocked in the buffered reader would hold its lock
        # at interpreter shutdown, which Python refuses.
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os._exit(1)

    threading.Thread(target=watch, name="gpipe-watch-launcher", daemon=True).start()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def launch(
    command: Sequence[str],
    processes: int,
    *,
    grace: float = 10.0,
    env: dict[str, str] | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``command`` as ``processes`` local ranks; the exit status for the launcher.

    Each rank inherits standard output and standard error. When the first rank cannot
    listen on the chosen port (another program took it meanwhile), the ranks start again
    with another one (3 tries). 0 when every rank exits with
    0; otherwise the failure of the rank that caused it is printed on ``stderr``, and the
    status is 1 (130 after ``KeyboardInterrupt``, 143 after ``SIGTERM``): a rank that died
    without reporting an
    error (killed, crashed) if any, else the first rank's own error with its traceback
    rather than the others' reports of it (``RemoteStageError``, which names it).

    Args:
        command: the program and its arguments, the same for every rank.
        processes: how many ranks.

    Keyword Args:
        grace: the seconds the other ranks have to end after one failed, before they are
            stopped.
        env: the environment of the ranks (default: this process's), to which the rank's
            variables are added.
        stderr: where the failure is told (default: ``sys.stderr``).
    """
    out = sys.stderr if stderr is None else stderr
    base = dict(os.environ if env is None else env)
    with _terminate_raises():
        return _launch(command, processes, grace, base, out)


class _Terminated(Exception):
    """``SIGTERM`` reached the launcher."""


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """Turn ``SIGTERM`` into :class:`_Terminated` (in the main thread), so that the ranks
    are stopped and reaped rather than left behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler not set from Python, which stays
            signal.signal(signal.SIGTERM, previous)


def _launch(
    command: Sequence[str], processes: int, grace: float, base: dict[str, str], out: TextIO
) -> int:
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        with tempfile.TemporaryDirectory(prefix="gpipe-ranks-") as tmp:
            files = [Path(tmp) / f"rank-{rank}.json" for rank in range(processes)]
            children: list[subprocess.Popen[bytes]] = []
            try:
                port = free_port()
                for rank in range(processes):
                    rank_env = dict(
                        base,
                        RANK=str(rank),
                        LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(processes),
                        LOCAL_WORLD_SIZE=str(processes),
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1",
                        **{ERROR_FILE: str(files[rank]), WATCH_LAUNCHER: "1"},
                    )
                    children.append(
                        subprocess.Popen(list(command), env=rank_env, stdin=subprocess.PIPE)
                    )
                failed = _wait(children, grace)
            except (KeyboardInterrupt, _Terminated) as stop:
                _stop(children)
                how, status = ("interrupted", 130)
                if isinstance(stop, _Terminated):
                    how, status = ("terminated", 143)
                print(f"{how}: stopped the {len(children)} ranks", file=out, flush=True)
                return status
            finally:
                stopped = _stop(children)  # all of them reaped, on any way out
            if not failed:
                return 0
            # The free port was taken before the first rank listened on it: another one.
            if attempt < _PORT_ATTEMPTS and _port_taken(files[0]):
                continue
            print(_failure(children, failed, stopped, files), file=out, flush=True)
            return 1
    raise AssertionError("unreachable")


def _port_taken(error_file: Path) -> bool:
    """Whether the first rank reported that its port was in use (and nothing else ran)."""
    error = _read_error(error_file)
    return error is not None and "EADDRINUSE" in error.message


def _wait(children: list[subprocess.Popen[bytes]], grace: float) -> list[int]:
    """Wait until every rank has exited, or ``grace`` seconds after the first failure;
    the ranks that failed, in the order they did."""
    failed: list[int] = []
    first_failure = 0.0
    while True:
        codes = [child.poll() for child in children]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in failed:
                failed.append(rank)
                first_failure = first_failure or time.monotonic()
        if all(code is not None for code in codes):
            return failed
        if failed and time.monotonic() - first_failure > grace:
            return failed
        time.sleep(_POLL)


def _stop(children: list[subprocess.Popen[bytes]]) -> list[int]:
    """End every rank still running (terminate, then kill) and reap all of them; the
    ranks that had to be ended."""
    stopped = []
    for rank, child in enumerate(children):
        if child.poll() is None:
            stopped.append(rank)
            with contextlib.suppress(OSError):
                child.terminate()
    deadline = time.monotonic() + _TERMINATE_WAIT
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, KeyboardInterrupt, _Terminated):  # slow, or again
            deadline = 0.0
            with contextlib.suppress(OSError):
                child.kill()
            child.wait()
        if child.stdin is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()
    return stopped


def _failure(
    children: list[subprocess.Popen[bytes]],
    failed: list[int],
    stopped: list[int],
    files: list[Path],
) -> str:
    """The message for a failed run: the error of the rank that caused it."""
    world = len(children)
    errors = {rank: error for rank in failed if (error := _read_error(files[rank])) is not None}
    note = f" (then ranks {stopped} were stopped)" if stopped else ""
    # A rank that died without a word (killed, crashed, or failed before it could report)
    # first: the others' errors are about it. Then a rank's own error, and last another
    # rank's report of a failure (which names the failing rank).
    silent = [rank for rank in failed if rank not in errors]
    if silent:
        rank = silent[0]
        code = children[rank].returncode
        return (
            f"error: rank {rank} of {world} {_describe_exit(code)} without reporting an error{note}"
        )
    own = [rank for rank in failed if not errors[rank].remote]
    rank = (own or failed)[0]
    return f"error: rank {rank} of {world} failed{note}:\n{errors[rank].traceback.rstrip()}"
