"""A recorded pipeline timeline: its tasks, a Chrome/Perfetto trace, a summary and a plot.

:meth:`GPipe.trace() <gpipe_core.GPipe.trace>` records every task the pipeline runs inside
its ``with`` block into a :class:`Timeline`. A task is partition ``j`` working on
micro-batch ``i`` in one :class:`Phase`; each is also labelled for
:mod:`torch.profiler` with :func:`task_label`.

It must not know how tasks run or are recorded (:mod:`gpipe_core.trace._tracing` builds a
timeline): a timeline is data.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from ..schedule._action import Phase
from ..schedule._schedules import GPipeSchedule

__all__ = [
    "PartitionSummary",
    "Phase",
    "TaskEvent",
    "Timeline",
    "TimelineSummary",
    "task_label",
    "theoretical_bubble",
]


#: The phases that keep a partition busy; copies run on their own streams.
_COMPUTE = frozenset(
    {
        Phase.FORWARD,
        Phase.RECOMPUTE,
        Phase.BACKWARD,
        Phase.INPUT_GRADIENT,
        Phase.WEIGHT_GRADIENT,
        Phase.LOSS,
    }
)


def task_label(phase: Phase | str, partition: int, microbatch: int) -> str:
    """The :func:`torch.profiler.record_function` label of a task.

    Labels read ``gpipe/<phase>/p<partition>/mb<micro-batch>``. A copy is labelled with
    the partition it feeds in forward (partition ``j`` for the copy between partitions
    ``j - 1`` and ``j``), in both directions.

    Example:
        >>> task_label(Phase.FORWARD, 1, 3)
        'gpipe/forward/p1/mb3'
        >>> task_label("recompute", 0, 0)
        'gpipe/recompute/p0/mb0'
    """
    return f"gpipe/{Phase(phase).value}/p{partition}/mb{microbatch}"


def reduction_label(partition: int) -> str:
    """The :func:`torch.profiler.record_function` label of a sharded partition's gradient
    reduction, once per step after its last backward task (see
    :mod:`gpipe_core.run._gradient_sync`): ``gpipe/reduce/p<partition>``.

    Example:
        >>> reduction_label(1)
        'gpipe/reduce/p1'
    """
    return f"gpipe/reduce/p{partition}"


def theoretical_bubble(partitions: int, microbatches: int) -> float:
    """The idle fraction of the fill-drain schedule with equal tasks: ``(n - 1) / (m + n - 1)``.

    It is :meth:`GPipeSchedule().bubble(m, n) <gpipe_core.Schedule.bubble>`, every action
    taking one unit of time: the one definition of a bubble gpipe-core has.

    Raises:
        ValueError: ``partitions`` or ``microbatches`` is not a positive integer.

    Example:
        >>> theoretical_bubble(4, 8)
        0.2727272727272727
    """
    return _fill_drain_bubble(partitions, microbatches)


@functools.lru_cache(maxsize=64)
def _fill_drain_bubble(partitions: int, microbatches: int) -> float:
    return GPipeSchedule().bubble(microbatches, partitions)


@dataclass(frozen=True)
class TaskEvent:
    """One recorded task.

    Times are in nanoseconds since the recording started: the host clock
    (``time.perf_counter_ns``) for CPU work, CUDA events on the partition's stream for
    CUDA work, put on the host clock after synchronisation.

    Attributes:
        phase: what the task did.
        partition: the partition ``j`` (for a copy: the partition it feeds in forward).
        microbatch: the micro-batch ``i``.
        run: which forward pass of the recording the task belongs to (0, 1, ...).
        start_ns: when the task started.
        end_ns: when the task ended.
        thread: the name of the thread that ran (or, on CUDA, launched) it.
        device: the device it ran on.
        backward: whether it ran in the backward pass (recompute, backward, and copies of
            gradients).
    """

    phase: Phase
    partition: int
    microbatch: int
    run: int
    start_ns: int
    end_ns: int
    thread: str
    device: str
    backward: bool

    @property
    def duration_ns(self) -> int:
        """How long the task took."""
        return self.end_ns - self.start_ns

    @property
    def label(self) -> str:
        """The task's :func:`task_label`."""
        return task_label(self.phase, self.partition, self.microbatch)


@dataclass(frozen=True)
class PartitionSummary:
    """Busy and idle time of one partition in a :class:`TimelineSummary`.

    Attributes:
        partition: the partition index.
        device: its device.
        busy_s: seconds spent in forward, recompute, backward (and loss) tasks.
        idle_s: seconds of the measured span without any such task.
        bubble: ``idle_s / (busy_s + idle_s)``.
    """

    partition: int
    device: str
    busy_s: float
    idle_s: float
    bubble: float


@dataclass(frozen=True)
class TimelineSummary:
    """Where the time went: per partition busy and idle time, and the bubble.

    The span is measured per pass: from the first to the last task of each forward pass,
    and from the first to the last task of each backward pass, so that the time between
    passes (the loss, the optimizer) does not count as bubble.

    Attributes:
        partitions: one :class:`PartitionSummary` per partition.
        microbatches: the number of micro-batches of each recorded forward pass.
        span_s: seconds inside the passes.
        bubble: the measured idle fraction, averaged over the partitions.
        theoretical_bubble: ``(n - 1) / (m + n - 1)``, the fill-drain bubble with equal
            tasks (:func:`theoretical_bubble`; averaged over the passes when they had
            different ``m``).
    """

    partitions: tuple[PartitionSummary, ...]
    microbatches: tuple[int, ...]
    span_s: float
    bubble: float
    theoretical_bubble: float

    def __str__(self) -> str:
        m = sorted(set(self.microbatches))
        sizes = "/".join(str(x) for x in m) or "0"
        lines = [
            f"timeline: {_count(len(self.partitions), 'partition')}, "
            f"{_count(len(self.microbatches), 'forward pass', 'forward passes')} of {sizes} "
            f"micro-batch{'' if sizes == '1' else 'es'}, "
            f"{self.span_s * 1e3:.3f} ms in passes",
            f"{'partition':<10} {'device':<8} {'busy ms':>10} {'idle ms':>10} {'bubble':>7}",
        ]
        for p in self.partitions:
            lines.append(
                f"{p.partition:<10} {p.device:<8} {p.busy_s * 1e3:>10.3f} "
                f"{p.idle_s * 1e3:>10.3f} {p.bubble:>7.1%}"
            )
        lines.append(
            f"bubble: {self.bubble:.1%} measured, "
            f"{self.theoretical_bubble:.1%} in theory ((n - 1) / (m + n - 1))"
        )
        return "\n".join(lines)


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: Iterable[tuple[int, int]]) -> int:
    return sum(end - start for start, end in intervals)


_COLORS = {
    Phase.FORWARD: "#4c72b0",
    Phase.RECOMPUTE: "#dd8452",
    Phase.BACKWARD: "#55a868",
    Phase.INPUT_GRADIENT: "#64b5cd",
    Phase.WEIGHT_GRADIENT: "#8172b3",
    Phase.COPY: "#8c8c8c",
    Phase.LOSS: "#c44e52",
}

# The README's install with the plot extra, as it gives it (the build session checks it).
_PLOT_INSTALL = 'pip install dist/gpipe-*.whl dist/gpipe_core-*.whl dist/gpipe_skip-*.whl dist/gpipe_bn-*.whl dist/gpipe_balance-*.whl dist/gpipe_checkpoint-*.whl dist/gpipe_microbatch-*.whl "gpipe[plot]"'  # noqa: E501
_PLOT_HINT = (
    "timeline.plot needs matplotlib: pip install matplotlib (or, from a checkout with the "
    f"wheels built into dist/: {_PLOT_INSTALL})"
)


class Timeline:
    """The tasks a :class:`~gpipe_core.GPipe` module ran inside a ``with model.trace()`` block.

    Use it once the block has exited: CUDA times are only known after synchronisation.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gpipe_core import GPipe
        >>> model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2)
        >>> with model.trace() as timeline:
        ...     model(torch.randn(4, 4)).sum().backward()
        >>> sorted({(e.phase.value, e.partition) for e in timeline.events})[:3]
        [('backward', 0), ('backward', 1), ('forward', 0)]
    """

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices: tuple[str, ...] = tuple(devices)
        #: The number of micro-batches of each forward pass recorded.
        self.microbatches: list[int] = []
        self._events: list[TaskEvent] = []
        self._recording = True

    @property
    def partitions(self) -> int:
        """The number of partitions."""
        return len(self.devices)

    @property
    def recording(self) -> bool:
        """Whether the ``with`` block that records this timeline is still running."""
        return self._recording

    @property
    def events(self) -> list[TaskEvent]:
        """The recorded tasks, by start time.

        Raises:
            RuntimeError: the ``with model.trace()`` block has not exited yet.
        """
        if self._recording:
            raise RuntimeError(
                "the timeline is still being recorded; use it after the "
                "'with model.trace()' block (recording: True)"
            )
        return list(self._events)

    def _finish(self, events: list[TaskEvent]) -> None:
        self._events = sorted(events, key=lambda e: (e.start_ns, e.end_ns, e.partition))
        self._recording = False

    # -- summary -------------------------------------------------------------------------

    def summary(self) -> TimelineSummary:
        """Busy time, idle time and the bubble of every partition; see :class:`TimelineSummary`.

        Example:
            >>> timeline = Timeline(["cpu"])
            >>> timeline._finish([])
            >>> timeline.summary().bubble
            0.0
        """
        events = self.events
        windows: dict[tuple[int, bool], tuple[int, int]] = {}
        for e in events:
            key = (e.run, e.backward)
            start, end = windows.get(key, (e.start_ns, e.end_ns))
            windows[key] = (min(start, e.start_ns), max(end, e.end_ns))
        span = _length(_union(windows.values()))
        partitions = []
        for j, device in enumerate(self.devices):
            busy = _length(
                _union(
                    (e.start_ns, e.end_ns)
                    for e in events
                    if e.partition == j and e.phase in _COMPUTE
                )
            )
            idle = span - busy
            partitions.append(
                PartitionSummary(j, device, busy / 1e9, idle / 1e9, idle / span if span else 0.0)
            )
        bubble = sum(p.bubble for p in partitions) / len(partitions) if partitions else 0.0
        theory = [theoretical_bubble(self.partitions, m) for m in self.microbatches]
        return TimelineSummary(
            partitions=tuple(partitions),
            microbatches=tuple(self.microbatches),
            span_s=span / 1e9,
            bubble=bubble,
            theoretical_bubble=sum(theory) / len(theory) if theory else 0.0,
        )

    # -- Chrome / Perfetto -------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline in the Chrome trace-event format, as a JSON-ready dictionary.

        One process, ``gpipe``; one track (``tid = j``) per partition named
        ``partition j (device)``, and one track ``partition j copies`` (``tid = 1000 + j``)
        where copies were recorded. Each task is a complete event (``"ph": "X"``) named by
        :func:`task_label`, with times in microseconds and the task's fields in ``args``.
        Flow events (``"ph": "s"`` and ``"f"``, category ``microbatch``) link each
        micro-batch's tasks from partition to partition: forward tasks from ``j`` to
        ``j + 1``, backward tasks from ``j + 1`` to ``j``.
        """
        events = self.events
        pid = 1
        trace: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "gpipe"}}
        ]
        copy_tracks = sorted({e.partition for e in events if e.phase is Phase.COPY})
        for j, device in enumerate(self.devices):
            trace.extend(_track_name(pid, j, f"partition {j} ({device})", 2 * j))
            if j in copy_tracks:
                trace.extend(_track_name(pid, 1000 + j, f"partition {j} copies", 2 * j + 1))
        for e in events:
            trace.append(
                {
                    "ph": "X",
                    "name": e.label,
                    "cat": e.phase.value,
                    "pid": pid,
                    "tid": _tid(e),
                    "ts": e.start_ns / 1e3,
                    "dur": e.duration_ns / 1e3,
                    "args": {
                        "phase": e.phase.value,
                        "partition": e.partition,
                        "microbatch": e.microbatch,
                        "run": e.run,
                        "thread": e.thread,
                        "device": e.device,
                    },
                }
            )
        trace.extend(self._flows(events, pid))
        return {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {"partitions": self.partitions, "microbatches": self.microbatches},
        }

    @staticmethod
    def _flows(events: list[TaskEvent], pid: int) -> list[dict[str, Any]]:
        # The first forward and the first backward task of each (run, partition, micro-batch)
        # (a graph differentiated twice has two backward tasks).
        first: dict[tuple[int, int, int, bool], TaskEvent] = {}
        for e in events:
            if e.phase in (Phase.FORWARD, Phase.BACKWARD, Phase.INPUT_GRADIENT):
                first.setdefault((e.run, e.partition, e.microbatch, e.backward), e)
        flows: list[dict[str, Any]] = []
        for (run, j, i, backward), source in first.items():
            target = first.get((run, j - 1 if backward else j + 1, i, backward))
            if target is None:
                continue
            common = {"name": f"mb{i}", "cat": "microbatch", "pid": pid, "id": len(flows) // 2}
            flows.append({**common, "ph": "s", "tid": _tid(source), "ts": source.start_ns / 1e3})
            flows.append(
                {**common, "ph": "f", "bp": "e", "tid": _tid(target), "ts": target.start_ns / 1e3}
            )
        return flows

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path``.

        Open the file in Perfetto (https://ui.perfetto.dev, "Open trace file") or in
        ``chrome://tracing``.
        """
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.chrome_trace(), file)

    # -- plot ----------------------------------------------------------------------------

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Draw a Gantt chart: one row per partition, time across, colored by phase.

        Each bar is a task, labelled with its micro-batch; copies are thin bars at the
        bottom of the row of the partition they feed. Needs matplotlib
        (``pip install matplotlib``).

        Args:
            path: where to save the figure (the format follows the extension, ``.png``
                say); nothing is saved when it is None.

        Returns:
            The matplotlib ``Figure``.

        Raises:
            ImportError: matplotlib is not installed.
        """
        try:
            import_module("matplotlib")
            figure_module = import_module("matplotlib.figure")
            patches = import_module("matplotlib.patches")
        except ImportError as error:
            raise ImportError(_PLOT_HINT) from error
        events = self.events
        summary = self.summary()
        figure = figure_module.Figure(figsize=(10, 1.2 + 0.7 * max(self.partitions, 1)))
        ax = figure.add_subplot()
        end_ms = max((e.end_ns for e in events), default=0) / 1e6
        phases = []
        for e in events:
            start, width = e.start_ns / 1e6, e.duration_ns / 1e6
            copy = e.phase is Phase.COPY
            y, height = (e.partition + 0.3, 0.2) if copy else (e.partition - 0.1, 0.7)
            ax.barh(
                y, width, left=start, height=height, color=_COLORS[e.phase],
                edgecolor="white", linewidth=0.5,
            )  # fmt: skip
            if e.phase not in phases:
                phases.append(e.phase)
            if not copy and end_ms > 0 and width > end_ms / 150:
                ax.text(
                    start + width / 2, y, str(e.microbatch), ha="center", va="center",
                    fontsize=7, color="white", clip_on=True,
                )  # fmt: skip
        ax.set_yticks(range(self.partitions))
        ax.set_yticklabels([f"partition {j}\n{d}" for j, d in enumerate(self.devices)])
        ax.set_ylim(self.partitions - 0.5, -0.6)
        ax.set_xlabel("time (ms)")
        ax.set_xlim(0, end_ms * 1.01 if end_ms else 1)
        handles = [patches.Patch(color=_COLORS[p], label=p.value) for p in Phase if p in phases]
        if handles:
            ax.legend(
                handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                ncols=len(handles), frameon=False,
            )  # fmt: skip
        ax.set_title(
            f"bubble {summary.bubble:.0%} measured, {summary.theoretical_bubble:.0%} in theory "
            "(bars labelled by micro-batch)",
            fontsize=9,
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
        figure.tight_layout()
        if path is not None:
            figure.savefig(path, dpi=120)
        return figure

    def __repr__(self) -> str:
        state = "recording" if self._recording else f"{len(self._events)} tasks"
        return f"Timeline(partitions={self.partitions}, {state})"


def _tid(event: TaskEvent) -> int:
    return 1000 + event.partition if event.phase is Phase.COPY else event.partition


def _track_name(pid: int, tid: int, name: str, order: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
        {
            "ph": "M",
            "name": "thread_sort_index",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": order},
        },
    ]


def _count(n: int, one: str, many: str | None = None) -> str:
    """``n`` with its noun: ``1 partition``, ``2 partitions``."""
    return f"{n} {one if n == 1 else many or one + 's'}"
