"""Recording a pipeline's tasks: profiler labels and the :class:`~gpipe_core.Timeline` recorder.

A pipeline run gets a :class:`Tracer` only when a ``with model.trace()`` block is recording
that model or a :mod:`torch.profiler` profile is active; otherwise :func:`tracer_for`
returns None and the pipeline runs exactly as it would without this module.

Every task a partition runs itself (a forward pass, a loss, and in a step a recomputation
and a backward pass) and every device copy goes through one entry point,
:meth:`Tracer.task`. When autograd runs a backward pass instead (the graph of
``GPipe.forward``), the partition marks it with two identity autograd functions: one on the
partition's output, whose backward runs first (the start; for a checkpointed micro-batch the
end of its recomputation is the start), and one on its input, whose backward runs last
(the end); the recomputation inside autograd is recognised by
:func:`~gpipe_checkpoint.is_recomputing`.

It must not know schedules or transports: it is called around each task and each device
copy.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any, TypeVar

import torch
import torch.autograd.profiler as _autograd_profiler
from torch import Tensor
from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

from gpipe_checkpoint import is_checkpointing, is_differentiable, is_recomputing
from gpipe_microbatch import Batch, get_phony

from .._stream import AbstractStream
from ._timeline import Phase, TaskEvent, Timeline, reduction_label, task_label

__all__ = ["Tracer", "record", "tracer_for"]

_T = TypeVar("_T")

# A point in time: host nanoseconds, or a CUDA event recorded on a stream of a device.
_Stamp = int | tuple[torch.cuda.Event, int]


class _Recorder:
    """Collects raw task records for one :class:`Timeline` and resolves them at the end."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.timeline = Timeline([str(device) for device in devices])
        self.lock = threading.Lock()
        self.raw: list[tuple[Phase, int, int, int, _Stamp, _Stamp, str, str, bool]] = []
        self.cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        # Each CUDA device's clock is tied to the host clock by one event recorded when
        # the device is idle.
        self.references: dict[int, tuple[torch.cuda.Event, int]] = {}
        for device in self.cuda:
            torch.cuda.synchronize(device)
            reference = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            # The device is idle, so the event completes as soon as it is recorded.
            host = time.perf_counter_ns()
            reference.record(torch.cuda.current_stream(device))
            reference.synchronize()
            self.references[device.index] = (reference, host)
        self.origin = time.perf_counter_ns()
        self.active = True

    def new_run(self, microbatches: int) -> int:
        with self.lock:
            self.timeline.microbatches.append(microbatches)
            return len(self.timeline.microbatches) - 1

    def add(
        self,
        phase: Phase,
        j: int,
        i: int,
        run: int,
        start: _Stamp,
        end: _Stamp,
        device: str,
        backward: bool,
    ) -> None:
        record = (phase, j, i, run, start, end, threading.current_thread().name, device, backward)
        with self.lock:
            if self.active:
                self.raw.append(record)

    def _resolve(self, stamp: _Stamp) -> int:
        if isinstance(stamp, int):
            return stamp - self.origin
        event, index = stamp
        reference, host = self.references[index]
        elapsed_ms = float(reference.elapsed_time(event))
        return host + round(elapsed_ms * 1e6) - self.origin

    def finish(self) -> Timeline:
        with self.lock:
            self.active = False
            raw, self.raw = self.raw, []
        for device in self.cuda:
            torch.cuda.synchronize(device)
        events = [
            TaskEvent(phase, j, i, run, self._resolve(start), self._resolve(end), thread, dev, bwd)
            for phase, j, i, run, start, end, thread, dev, bwd in raw
        ]
        self.timeline._finish(events)
        return self.timeline


# The recorders of the modules being traced, by id (a recorder holds its module, so the
# id stays unique while it is here).
_recorders: dict[int, tuple[object, _Recorder]] = {}
_recorders_lock = threading.Lock()


@contextmanager
def record(module: object, devices: list[torch.device]) -> Iterator[Timeline]:
    """Record the tasks of ``module``'s pipeline runs; the body of ``GPipe.trace``."""
    with _recorders_lock:
        if id(module) in _recorders:
            raise RuntimeError(
                "this GPipe module is already being traced; 'with model.trace()' "
                "blocks of one module cannot be nested (recording: True)"
            )
        recorder = _Recorder(devices)
        _recorders[id(module)] = (module, recorder)
    try:
        yield recorder.timeline
    finally:
        with _recorders_lock:
            del _recorders[id(module)]
        recorder.finish()


def _stamp(stream: AbstractStream) -> _Stamp:
    if isinstance(stream, torch.cuda.Stream):
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event, stream.device.index
    return time.perf_counter_ns()


def _profiling() -> bool:
    """Whether a profiler is active: in this thread, or in all threads (``profile_all_threads``)."""
    return bool(getattr(_autograd_profiler, "_is_profiler_enabled", False)) or bool(
        _profiler_enabled()
    )


def tracer_for(module: object, microbatches: int) -> Tracer | None:
    """The tracer of a pipeline run of ``module``, or None when nothing records it."""
    entry = _recorders.get(id(module)) if _recorders else None
    profile = _profiling()
    if entry is None and not profile:
        return None
    recorder = entry[1] if entry is not None else None
    tracer = Tracer(recorder, profile, recorder.new_run(microbatches) if recorder else 0)
    # A profiler started in this thread alone does not see the worker threads.
    tracer.local_profile = profile and bool(_profiler_enabled())
    return tracer


_WORKERS_UNSEEN = (
    "torch.profiler records only the thread that started it (and autograd's threads), so "
    "it misses the tasks that gpipe runs on its worker threads (the forward tasks of a "
    "forward pass, every task of a step); to see them, pass "
    "experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True) "
    "to torch.profiler.profile"
)
_warned = False


def _warn_workers_unseen() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(_WORKERS_UNSEEN, UserWarning, stacklevel=2)


class _Span:
    """An open task: its start and its profiler range, if any."""

    __slots__ = ("label", "start")

    def __init__(self, start: _Stamp | None, label: record_function | None) -> None:
        self.start = start
        self.label = label


class Tracer:
    """Labels and records the tasks of one pipeline run.

    Args:
        recorder: where task times go, or None to only label tasks for the profiler.
        profile: whether to open :func:`torch.profiler.record_function` ranges.
        run: the index of this run in the recording.
    """

    def __init__(self, recorder: _Recorder | None, profile: bool, run: int) -> None:
        self.recorder = recorder
        self.profile = profile
        self.run_index = run
        self.local_profile = False
        self.caller = threading.get_ident()
        self.lock = threading.Lock()
        # Backward tasks started and not yet ended, by (partition, micro-batch).
        self.open: dict[tuple[int, int], _Span] = {}

    def _active(self) -> bool:
        return self.recorder is None or self.recorder.active

    # -- spans ---------------------------------------------------------------------------

    def _begin(self, phase: Phase, i: int, j: int, stream: AbstractStream) -> _Span | None:
        """Start a task of partition ``j`` on micro-batch ``i``; None once recording is over."""
        if not self._active():
            return None
        start = _stamp(stream) if self.recorder is not None else None
        label = None
        if self.profile:
            label = record_function(task_label(phase, j, i))
            label.__enter__()  # type: ignore[no-untyped-call]
        return _Span(start, label)

    def _end(
        self,
        span: _Span,
        phase: Phase,
        i: int,
        j: int,
        device: torch.device,
        stream: AbstractStream,
        backward: bool,
    ) -> None:
        """End a task started by :meth:`_begin` and record it."""
        if span.label is not None:
            span.label.__exit__(None, None, None)
        if self.recorder is not None and span.start is not None:
            end = _stamp(stream)
            self.recorder.add(phase, j, i, self.run_index, span.start, end, str(device), backward)

    def reducing(self, j: int) -> AbstractContextManager[object]:
        """Around partition ``j``'s gradient reduction (a sharded partition's, after its last
        backward task): its :func:`reduction_label` range, where the run is profiled."""
        if self.profile and self._active():
            return record_function(reduction_label(j))
        return nullcontext()

    def task(
        self,
        phase: Phase,
        i: int,
        j: int,
        device: torch.device,
        stream: AbstractStream,
        backward: bool,
        function: Callable[[], _T],
    ) -> _T:
        """Run ``function`` as the task ``phase`` of partition ``j`` on micro-batch ``i``.

        The one entry point through which every task of a run is labelled and timed (a
        task that raises is not recorded).
        """
        if self.local_profile and threading.get_ident() != self.caller:
            _warn_workers_unseen()
        span = self._begin(phase, i, j, stream)
        if span is None:
            return function()
        try:
            result = function()
        except BaseException:
            if span.label is not None:
                span.label.__exit__(None, None, None)
            raise
        self._end(span, phase, i, j, device, stream, backward)
        return result

    # -- forward, recompute, backward ----------------------------------------------------

    def recomputed(
        self,
        function: Callable[[Any], object],
        i: int,
        j: int,
        device: torch.device,
        stream: AbstractStream,
    ) -> Callable[[Any], object]:
        """Wrap a checkpointed function so that its recomputation is recorded."""

        def traced(input: Any) -> object:
            # A checkpoint phase inside an outer recomputation (a nested GPipe) is not one.
            if not is_recomputing() or is_checkpointing():
                return function(input)
            output = self.task(
                Phase.RECOMPUTE, i, j, device, stream, True, partial(function, input)
            )
            self._start_backward(i, j, stream)
            return output

        return traced

    def input(
        self,
        batch: Batch,
        i: int,
        j: int,
        device: torch.device,
        stream: AbstractStream,
        force: bool,
    ) -> None:
        """Mark the end of partition ``j``'s backward on ``batch``, its input (in place).

        ``force``: mark it even when the input needs no gradient (the partition has
        parameters to train, so its backward runs anyway).
        """
        self._mark(batch, partial(self._end_backward, i, j, device, stream), force=force)

    def output(self, batch: Batch, i: int, j: int, stream: AbstractStream) -> None:
        """Mark the start of partition ``j``'s backward on ``batch``, its output (in place)."""
        self._mark(batch, partial(self._start_backward, i, j, stream))

    def _start_backward(self, i: int, j: int, stream: AbstractStream) -> None:
        span = self._begin(Phase.BACKWARD, i, j, stream)
        if span is None:
            return
        with self.lock:
            previous = self.open.pop((i, j), None)
            self.open[(i, j)] = span
        if previous is not None and previous.label is not None:
            previous.label.__exit__(None, None, None)

    def _end_backward(self, i: int, j: int, device: torch.device, stream: AbstractStream) -> None:
        with self.lock:
            span = self.open.pop((i, j), None)
        if span is not None:
            self._end(span, Phase.BACKWARD, i, j, device, stream, True)

    # -- copies --------------------------------------------------------------------------

    def copy(
        self,
        copy: Callable[[], object],
        batch: Batch,
        i: int,
        j: int,
        prev_stream: AbstractStream,
        next_stream: AbstractStream,
        device: torch.device,
        backward: bool = False,
    ) -> None:
        """Run ``copy``, the transport's copy of ``batch`` into partition ``j``, recorded.

        The copy is queued on ``next_stream``; when autograd carries its gradient back (on
        ``prev_stream``), that copy is recorded too, between two markers. ``backward``:
        the batch holds gradients (a copy in a backward pass).
        """
        spans: list[_Span] = []

        def back_start() -> None:
            span = self._begin(Phase.COPY, i, j, prev_stream)
            if span is not None:
                spans.append(span)

        def back_end() -> None:
            if spans:
                self._end(spans.pop(), Phase.COPY, i, j, device, prev_stream, True)

        self._mark(batch, back_end)
        self.task(Phase.COPY, i, j, device, next_stream, backward, copy)
        self._mark(batch, back_start)

    # -- markers -------------------------------------------------------------------------

    def _mark(self, batch: Batch, callback: Callable[[], None], force: bool = False) -> None:
        """Make ``callback`` run when the gradient of ``batch`` is computed (in place)."""
        if not torch.is_grad_enabled():
            return
        indices = [k for k, tensor in enumerate(batch) if tensor.requires_grad]
        if not indices and not force:
            return
        # A phony that requires grad makes the marker's backward run even when no input
        # needs a gradient; then every floating-point input needs one.
        phony = get_phony(batch[0].device, requires_grad=True) if not indices else None
        if phony is not None:
            indices = [k for k, t in enumerate(batch) if is_differentiable(t)]
            if not indices:
                return
        tensors = _Marker.apply(callback, phony, *(batch[k] for k in indices))  # type: ignore[no-untyped-call]
        for k, tensor in zip(indices, tensors, strict=True):
            batch.replace(k, tensor)


class _Marker(torch.autograd.Function):
    """An identity whose backward calls a callback first.

    Called as ``_Marker.apply(callback, phony_or_none, *tensors)``.
    """

    @staticmethod
    def forward(
        ctx: Any, callback: Callable[[], None], phony: Tensor | None, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.callback = callback
        return tuple(tensor.detach() for tensor in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        ctx.callback()
        return (None, None, *grads)
