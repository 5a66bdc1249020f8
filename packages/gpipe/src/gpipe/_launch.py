"""Local ranks: start a command in several processes of one gloo group, and reap them.

:func:`launch` runs the same command as ranks ``0 .. n-1`` on this host through torch's
elastic launch (:func:`torch.distributed.launcher.api.elastic_launch`, what ``torchrun``
runs): the agent in this process starts the ranks with ``torchrun``'s environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, the agent's
store, so no port can be taken between its choice and its use), watches them, stops the
others when one fails, and reaps every one of them, also on ``KeyboardInterrupt`` (Ctrl-C)
and ``SIGTERM``. A rank tells what it raised through torch's error file (``@record``'s
protocol, see :func:`report_error`).

What torch lacks, kept here:

- **The failing rank's error first.** The agent stops every other rank as soon as it sees
  one exit with an error. A rank told of another's failure (``RemotePartitionError``) would
  often exit before the rank that failed has written its error, which the agent would
  then stop before it could. So a told rank waits (:func:`report_error`, up to
  ``grace`` seconds) and the agent sees the failing rank first; and of the errors the
  ranks wrote, the report prefers a rank's own error to the others' reports of it.
- **Ranks end with their launcher.** The agent starts its ranks in sessions of their own,
  with nothing that ends them when it dies: a ``SIGKILL`` of the launcher would leave them
  running. Each rank watches its parent (:func:`watch_launcher`).
- **One intra-op thread per rank** and the ranks' environment (``env``), which the agent
  takes from this process's.
- **One line for the failure** on standard error, rather than the agent's log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from gpipe_core import RemotePartitionError

__all__ = [
    "GRACE",
    "WATCH_LAUNCHER",
    "RankError",
    "launch",
    "report_error",
    "watch_launcher",
]

#: The environment variable with the launcher's process id, for ranks that end with it.
WATCH_LAUNCHER = "GPIPE_WATCH_LAUNCHER"
#: The environment variable with the seconds a told rank waits before it exits.
GRACE = "GPIPE_TOLD_RANK_GRACE"
#: The environment variable naming the file a rank writes its error to (torch's).
_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: How often the agent looks at its ranks, and a rank at its launcher, in seconds.
_POLL = 0.05
_WATCH_POLL = 0.2
#: How long a stopped rank has to exit before it is killed, in seconds.
_TERMINATE_WAIT = 5


@dataclass(frozen=True)
class RankError:
    """What a rank reported it raised, or how it ended without a report."""

    rank: int
    #: The exit status (negative: the signal that killed it).
    exitcode: int
    #: ``"Type: message"`` from the rank's error file; empty without one.
    message: str
    traceback: str

    @property
    def reported(self) -> bool:
        """Whether the rank wrote its error."""
        return bool(self.message)

    @property
    def remote(self) -> bool:
        """Whether it is another rank's failure, told to this one (``RemotePartitionError``)."""
        return self.message.startswith(f"{RemotePartitionError.__name__}:")


def report_error(error: BaseException) -> bool:
    """In a rank, inside the ``except`` block that caught ``error``: write it to torch's
    error file (where the launcher, or ``torchrun``, reads it); a told rank
    (``RemotePartitionError``) then waits up to ``GPIPE_TOLD_RANK_GRACE`` seconds, so that the
    rank that failed ends first and its error is the one reported.

    Returns whether it was written: not outside a launched rank (no
    ``TORCHELASTIC_ERROR_FILE``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class PartialFileErrorHandler(ErrorHandler):
        def _get_error_file_path(self) -> str | None:
            return partial

    path = os.environ.get(_ERROR_FILE)
    if not path:
        return False
    # The file is written beside the agent's and renamed over it once whole: the agent reads
    # it as soon as the rank ends, and may stop a told rank while it writes; half a file
    # would fail the agent (JSONDecodeError) instead of naming the rank that failed.
    partial = f"{path}.partial"
    PartialFileErrorHandler().record_exception(error)
    os.replace(partial, path)
    if isinstance(error, RemotePartitionError):
        time.sleep(float(os.environ.get(GRACE, "0")))  # the agent stops it sooner
    return True


def watch_launcher() -> None:
    """In a rank started by :func:`launch`: exit at once if the launcher goes away.

    The launcher is the rank's parent; when it ends (even by ``SIGKILL``), the rank gets
    another parent, which a thread here notices. Nothing is done without
    ``GPIPE_WATCH_LAUNCHER`` in the environment (under ``torchrun``, for one).
    """
    launcher = os.environ.get(WATCH_LAUNCHER)
    if not launcher:
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(_WATCH_POLL)
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
    env: Mapping[str, str] | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``command`` as ``processes`` local ranks; the exit status for the launcher.

    Each rank inherits standard output and standard error. 0 when every rank exits with 0;
    otherwise the failure of the rank that caused it is printed on ``stderr``, and the
    status is 1 (130 after ``KeyboardInterrupt``, 143 after ``SIGTERM``): a rank that died
    without reporting an error (killed, crashed) if any, else a rank's own error with its
    traceback rather than the others' reports of it (``RemotePartitionError``, which names
    it). Call it from the main thread (the agent handles the signals there).

    Args:
        command: the program and its arguments, the same for every rank.
        processes: how many ranks.

    Keyword Args:
        grace: the seconds a rank told of another's failure waits before it exits, so
            that the rank that failed is seen first (the agent then stops the others).
        env: the environment of the ranks (default: this process's), to which the rank's
            variables are added.
        stderr: where the failure is told (default: ``sys.stderr``).
    """
    out = sys.stderr if stderr is None else stderr
    # The agent keeps the ranks' error files in a folder of its own, which it never
    # removes: this run's is removed when the run ends (the failure is read by then).
    with tempfile.TemporaryDirectory(prefix="gpipe-ranks-") as files:
        return _launch(command, processes, grace, env, out, files)


def _launch(
    command: Sequence[str],
    processes: int,
    grace: float,
    env: Mapping[str, str] | None,
    out: TextIO,
    files: str,
) -> int:
    """:func:`launch`, the agent keeping the ranks' files in the folder ``files``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=files),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # the agent's store, on a port it holds
        max_restarts=0,
        monitor_interval=_POLL,
        local_addr="127.0.0.1",
        shutdown_timeout=_TERMINATE_WAIT,
    )
    ranks_env = {
        **(os.environ if env is None else env),
        "OMP_NUM_THREADS": "1",
        WATCH_LAUNCHER: str(os.getpid()),
        GRACE: str(grace),
    }
    with _environment(ranks_env), _quiet("torch.distributed.elastic"):
        try:
            elastic_launch(config, entrypoint=command[0])(*command[1:])
        except ChildFailedError as failed:
            print(_failure(failed.failures, processes), file=out, flush=True)
            return 1
        except (KeyboardInterrupt, SignalException) as stop:
            terminated = getattr(stop, "sigval", None) == signal.SIGTERM
            how, status = ("terminated", 143) if terminated else ("interrupted", 130)
            print(f"{how}: stopped the {processes} ranks", file=out, flush=True)
            return status
    return 0


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Make ``env`` this process's environment while the agent starts the ranks (it gives
    them its own), then restore it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence the agent's log (its progress and its own account of a failure): the
    launcher prints the failure once, its own way."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _errors(failures: Mapping[int, Any]) -> list[RankError]:
    """The failed ranks, in the order of their global rank, from the agent's account."""
    errors = []
    for rank, failure in sorted(failures.items()):
        message, trace = "", ""
        if isinstance(failure.message, dict):  # from the rank's error file
            message = str(failure.message.get("message", ""))
            trace = str(failure.message.get("extraInfo", {}).get("py_callstack", ""))
        errors.append(RankError(rank, int(failure.exitcode), message, trace))
    return errors


def _failure(failures: Mapping[int, Any], world: int) -> str:
    """The message for a failed run: the error of the rank that caused it."""
    errors = _errors(failures)
    # The ranks the agent stopped once the run had failed (a told rank has reported).
    stopped = [e.rank for e in errors if e.exitcode == -signal.SIGTERM]
    note = f" (then ranks {stopped} were stopped)" if stopped else ""
    # A rank that died without a word (killed, crashed, or failed before it could report)
    # first: the others' errors are about it. Then a rank's own error, and last another
    # rank's report of a failure (which names the failing rank).
    silent = [e for e in errors if not e.reported and e.rank not in stopped]
    if silent:
        rank, code = silent[0].rank, silent[0].exitcode
        return f"error: rank {rank} of {world} {_describe_exit(code)} without reporting an error"
    reported = [e for e in errors if e.reported]
    if not reported:  # every failed rank was stopped: say so
        return f"error: ranks {stopped} of {world} were stopped without reporting an error"
    own = [e for e in reported if not e.remote]
    error = (own or reported)[0]
    text = (error.traceback or error.message).rstrip()
    return f"error: rank {error.rank} of {world} failed{note}:\n{text}"
