"""Worker threads: one per worker of a process, each fed its part of a run through a queue.

A :class:`WorkerPool` belongs to one GPipe module. Its threads start on the first run that
needs them and live until the module is garbage-collected (or :meth:`WorkerPool.close` is
called): starting threads on every pass would also start new OpenMP thread teams every
pass. The threads hold no reference to the module, only to their queues, so collecting
the module stops them.

Grad mode and autocast are thread-local in PyTorch, so the runner applies the caller's
:class:`~gpipe_microbatch.ThreadState` in each worker for the run.

It must not know partitions, schedules or the transport: a worker runs the jobs it is given
and reports what they raised.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from types import TracebackType
from typing import cast

__all__ = ["ExcInfo", "Jobs", "WorkerPool"]

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]


def _worker_loop(in_queue: SimpleQueue[_Job | None]) -> None:
    while True:
        job = in_queue.get()
        if job is None:
            return
        job.run()  # reports its own end and errors
        del job


class _Job:
    """A partition's part of a run, as its worker runs it (see :meth:`WorkerPool.run_jobs`).

    Whatever happens, its end is counted, an exception going to ``failed`` first.
    """

    __slots__ = ("ended", "failed", "function")

    def __init__(
        self,
        function: Callable[[], object],
        failed: Callable[[ExcInfo], None],
        ended: _Ended,
    ) -> None:
        self.function: Callable[[], object] | None = function
        self.failed = failed
        self.ended = ended

    def run(self) -> None:
        try:
            assert self.function is not None
            self.function()
        except BaseException:
            self.failed(cast(ExcInfo, sys.exc_info()))
        finally:
            self.function = None
            self.ended.add()


class _Ended:
    """How many jobs of a run have ended; the caller waits for all of them, woken once."""

    def __init__(self) -> None:
        self.count = 0
        #: The count the caller waits for (None: nobody waits).
        self.awaited: int | None = None
        self.changed = threading.Condition()

    def add(self) -> None:
        with self.changed:
            self.count += 1
            # Only the job that ends the wait wakes the caller.
            if self.awaited is not None and self.count >= self.awaited:
                self.changed.notify()

    def wait(self, count: int) -> None:
        with self.changed:
            self.awaited = count
            try:
                while self.count < count:
                    self.changed.wait()
            finally:
                self.awaited = None


class Jobs:
    """Jobs started on a pool's workers one by one, while the calling thread holds the pool
    (see :meth:`WorkerPool.run_here`); a job may start others."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.ended = _Ended()
        self.started = 0
        self.lock = threading.Lock()

    def start(
        self, worker: int, function: Callable[[], object], failed: Callable[[ExcInfo], None]
    ) -> None:
        """Run ``function`` on ``worker``'s thread; what it raises goes to ``failed``."""
        with self.lock:
            self.started += 1
        try:
            self.pool._submit(worker, _Job(function, failed, self.ended))
        except BaseException:
            self.ended.add()  # never started: counted as ended
            raise

    def wait(self) -> None:
        """Wait until every job started, those started by jobs included, has ended."""
        while True:
            with self.lock:
                count = self.started
            self.ended.wait(count)
            with self.lock:
                if self.started == count:
                    return


class _Starter:
    """Starts threads from a thread of its own, for every pool of the process.

    CPython gives a new thread's state the identity of the thread that creates it until
    the new thread runs. An asynchronous exception aimed at the creating thread (a signal's
    ``KeyboardInterrupt``, or ``PyThreadState_SetAsyncExc`` as timeout helpers use) may
    then land in the new thread before it has started: it dies, and ``Thread.start``
    waits forever for it. Nothing aims such exceptions at this thread, started at import.
    """

    def __init__(self) -> None:
        self.requests: SimpleQueue[tuple[list[threading.Thread], _Request]] = SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="gpipe-starter", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            threads, request = self.requests.get()
            try:
                for thread in threads:
                    if thread.ident is None:  # not started (a started thread has an ident)
                        thread.start()
            except BaseException as error:  # handed to the caller, which raises it
                request.error = error
            finally:
                request.done.set()
            del threads, request

    def start(self, threads: list[threading.Thread]) -> None:
        """Start the threads of ``threads`` not yet started; return once all have.

        Raises:
            RuntimeError: the starter thread is gone.
            BaseException: what starting a thread raised.
        """
        request = _Request()
        self.requests.put((threads, request))
        while not request.done.wait(1.0):
            if not self.thread.is_alive():
                raise RuntimeError("gpipe's thread starter has stopped; no worker can start")
        if request.error is not None:
            error, request.error = request.error, None
            raise error


class _Request:
    """One request to the starter: set when done, with the error of a failed start."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


_starter: _Starter | None = _Starter()


def _forget_starter() -> None:
    global _starter
    # The starter thread does not survive a fork; a child that starts workers (rarely: a
    # DataLoader worker does not) makes its own, so forked children start no thread.
    _starter = None


def _get_starter() -> _Starter:
    global _starter
    if _starter is None:
        _starter = _Starter()
    return _starter


os.register_at_fork(after_in_child=_forget_starter)


class WorkerPool:
    """One worker thread per partition.

    Only one pipeline run uses the pool at a time: :attr:`lock` is held for the run.
    """

    def __init__(self, workers: int) -> None:
        self.lock = threading.Lock()
        self.in_queues: list[SimpleQueue[_Job | None]] = [SimpleQueue() for _ in range(workers)]
        self.threads: list[threading.Thread] = []
        self.started = False
        self.closed = False
        #: The thread whose run holds the pool, if any.
        self.owner: int | None = None

    def _start(self) -> None:
        # Every thread is listed before any starts, and the pool counts as started only
        # once all have: a caller interrupted here (KeyboardInterrupt) leaves threads not
        # yet started, which the next call starts, and never a queue without a worker.
        if not self.threads:
            self.threads = [
                threading.Thread(
                    target=_worker_loop, args=(in_queue,), name=f"gpipe-worker-{j}", daemon=True
                )
                for j, in_queue in enumerate(self.in_queues)
            ]
        _get_starter().start(self.threads)
        self.started = True

    def _submit(self, partition: int, job: _Job) -> None:
        if self.closed:
            raise RuntimeError("the worker pool of this GPipe module is closed")
        if not self.started:
            self._start()
        self.in_queues[partition].put(job)

    def run_jobs(
        self,
        jobs: Sequence[Callable[[], object]],
        failed: Callable[[int, ExcInfo], None],
        stop: Callable[[], None],
    ) -> None:
        """Run ``jobs[j]`` on partition ``j``'s worker, for every ``j``, and wait for all.

        A job that raises reports to ``failed(j, exc_info)``; the caller raises what it
        keeps. Each job reports its own end, so an interrupt in the caller
        (``KeyboardInterrupt``), wherever it lands, is handled alike: the caller calls
        ``stop()``, which must make every job end soon, waits for them, and raises; the
        next run finds the workers idle.

        Raises:
            RuntimeError: see :meth:`refuse_reentry`.
        """
        self.refuse_reentry()
        with self.lock:
            self.owner = threading.get_ident()
            ended = _Ended()
            submitted = 0
            try:
                for j, job in enumerate(jobs):
                    self._submit(j, _Job(job, functools.partial(failed, j), ended))
                    submitted += 1
                ended.wait(submitted)
            except BaseException:
                stop()
                ended.wait(submitted)
                raise
            finally:
                self.owner = None

    def run_here(self, main: Callable[[Jobs], object]) -> None:
        """Run ``main(jobs)`` in the calling thread, which holds the pool as a run of
        :meth:`run_jobs` does; ``main`` may start jobs on the workers (``jobs.start``),
        and they are waited for before this returns, also where ``main`` raises (it must
        then make them end soon).

        Raises:
            RuntimeError: see :meth:`refuse_reentry`.
        """
        self.refuse_reentry()
        with self.lock:
            self.owner = threading.get_ident()
            jobs = Jobs(self)
            try:
                main(jobs)
            finally:
                try:
                    jobs.wait()
                finally:
                    self.owner = None

    def refuse_reentry(self) -> None:
        """Refuse a run started from inside a run of this pool.

        Raises:
            RuntimeError: called from one of this pool's workers, or from the thread whose
                run holds the pool (a layer or hook re-entering its own module): waiting for
                the workers would wait for itself.
        """
        current = threading.current_thread()
        if current in self.threads or self.owner == current.ident:
            raise RuntimeError(
                "a GPipe module was called from inside its own run (a layer or a hook of the "
                "module called it, or its step, again); it cannot wait for its own workers, "
                f"so re-entering a module is not supported (thread: {current.name})"
            )

    def close(self) -> None:
        """Stop every worker after its current job and wait for them (idempotent)."""
        self.closed = True
        threads = [thread for thread in self.threads if thread.ident is not None]
        self.threads = []
        for in_queue in self.in_queues:
            in_queue.put(None)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join()
