"""The timeline recorder: the recorded tasks, their order, the Chrome trace and the summary."""

from __future__ import annotations

import copy
import gc
import itertools
import json
import re
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES, Pop, Stash
from core_support.turns import measured_short
from gpipe_core import GPipe, Phase, TaskEvent, Timeline, task_label, theoretical_bubble
from gpipe_core.run._turns import Turns
from gpipe_core.trace import _tracing as tracing

N, M = 3, 4


def p3m4(checkpoint: str = "except_last", width: int = 8) -> GPipe:
    torch.manual_seed(0)
    layers = [nn.Linear(width, width) if k % 2 == 0 else nn.Tanh() for k in range(6)]
    return GPipe(nn.Sequential(*layers), [2, 2, 2], chunks=M, checkpoint=checkpoint)


def traced_step(model: GPipe, x: torch.Tensor) -> Timeline:
    with model.trace() as timeline:
        model(x).sum().backward()
    return timeline


def keys(timeline: Timeline, phase: Phase) -> list[tuple[int, int]]:
    return sorted((e.partition, e.microbatch) for e in timeline.events if e.phase is phase)


def by_task(timeline: Timeline, phase: Phase) -> dict[tuple[int, int], TaskEvent]:
    return {(e.partition, e.microbatch): e for e in timeline.events if e.phase is phase}


ALL = sorted((j, i) for j in range(N) for i in range(M))


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("checkpoint", MODES)
def test_p3m4_records_exactly_the_expected_tasks(
    checkpoint: str, input_requires_grad: bool
) -> None:
    model = p3m4(checkpoint)
    x = torch.randn(8, 8, requires_grad=input_requires_grad)
    timeline = traced_step(model, x)

    stop = {"always": M, "except_last": M - 1, "never": 0}[checkpoint]
    assert keys(timeline, Phase.FORWARD) == ALL
    assert keys(timeline, Phase.BACKWARD) == ALL
    assert keys(timeline, Phase.RECOMPUTE) == sorted((j, i) for j, i in ALL if i < stop)
    assert keys(timeline, Phase.COPY) == []  # one device: nothing to copy
    assert keys(timeline, Phase.LOSS) == []
    assert len(timeline.events) == 2 * N * M + N * stop
    assert timeline.microbatches == [M]
    for e in timeline.events:
        assert e.run == 0
        assert e.device == "cpu"
        assert e.end_ns >= e.start_ns >= 0
        assert e.backward == (e.phase is not Phase.FORWARD)
        if e.phase is Phase.FORWARD:
            assert e.thread == f"gpipe-worker-{e.partition}"


@pytest.mark.parametrize("checkpoint", MODES)
def test_p3m4_respects_the_dependencies(checkpoint: str) -> None:
    model = p3m4(checkpoint)
    timeline = traced_step(model, torch.randn(8, 8, requires_grad=True))
    forward = by_task(timeline, Phase.FORWARD)
    backward = by_task(timeline, Phase.BACKWARD)
    recompute = by_task(timeline, Phase.RECOMPUTE)
    for (j, i), task in forward.items():
        if j > 0:
            assert task.start_ns >= forward[j - 1, i].end_ns, (j, i)
        if i > 0:
            assert task.start_ns >= forward[j, i - 1].end_ns, (j, i)
    # Backward starts once the whole forward pass is over.
    last_forward = max(e.end_ns for e in forward.values())
    for (j, i), task in backward.items():
        first = recompute.get((j, i), task)
        assert first.start_ns >= last_forward
        if (j, i) in recompute:
            assert task.start_ns >= recompute[j, i].end_ns, (j, i)
        if j < N - 1:
            assert first.start_ns >= backward[j + 1, i].end_ns, (j, i)
        if i < M - 1:
            assert first.start_ns >= backward[j, i + 1].end_ns, (j, i)


def test_one_run_per_forward_pass() -> None:
    model = p3m4()
    with model.trace() as timeline:
        for batch in (8, 8, 3):
            model(torch.randn(batch, 8)).sum().backward()
    assert timeline.microbatches == [M, M, 3]
    runs = Counter((e.run, e.phase) for e in timeline.events)
    assert runs[0, Phase.FORWARD] == runs[1, Phase.FORWARD] == N * M
    assert runs[2, Phase.FORWARD] == N * 3
    assert runs[2, Phase.BACKWARD] == N * 3


def test_eval_and_no_grad_record_forward_only() -> None:
    model = p3m4()
    with model.trace() as timeline, torch.no_grad():
        model(torch.randn(8, 8))
    assert keys(timeline, Phase.FORWARD) == ALL
    assert len(timeline.events) == N * M


class SlowDropout(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return super().forward(x)


def test_forward_tasks_waiting_for_the_generator_lock_are_not_busy() -> None:
    # Checkpointed partitions that draw random numbers on one device take turns under the
    # device's generator lock: a task's time starts once it holds the lock.
    torch.manual_seed(0)
    layers = [m for _ in range(N) for m in (nn.Linear(4, 4), SlowDropout(0.5))]
    model = GPipe(nn.Sequential(*layers), [2] * N, chunks=M, checkpoint="always")
    with model.trace() as timeline:
        model(torch.randn(8, 4, requires_grad=True))
    forward = sorted((e.start_ns, e.end_ns) for e in timeline.events if e.phase is Phase.FORWARD)
    assert len(forward) == N * M
    for (_, end), (start, _) in itertools.pairwise(forward):
        assert start >= end


def test_one_partition_runs_in_the_calling_thread() -> None:
    model = GPipe(nn.Sequential(nn.Linear(4, 4)), [1], chunks=2)
    timeline = traced_step(model, torch.randn(4, 4))
    assert keys(timeline, Phase.FORWARD) == [(0, 0), (0, 1)]
    assert keys(timeline, Phase.BACKWARD) == [(0, 0), (0, 1)]
    assert {e.thread for e in timeline.events if e.phase is Phase.FORWARD} == {"MainThread"}


def test_labels() -> None:
    assert task_label(Phase.BACKWARD, 2, 11) == "gpipe/backward/p2/mb11"
    assert task_label("copy", 0, 0) == "gpipe/copy/p0/mb0"
    assert [str(p) for p in Phase] == [
        "forward",
        "recompute",
        "backward",
        "input-gradient",
        "weight-gradient",
        "copy",
        "loss",
    ]
    with pytest.raises(ValueError):
        task_label("sideways", 0, 0)


# -- summary --------------------------------------------------------------------------------


def test_summary() -> None:
    timeline = traced_step(p3m4(), torch.randn(8, 8))
    summary = timeline.summary()
    assert summary.theoretical_bubble == pytest.approx((N - 1) / (M + N - 1))
    assert summary.theoretical_bubble == theoretical_bubble(N, M)
    assert summary.microbatches == (M,)
    assert len(summary.partitions) == N
    for j, part in enumerate(summary.partitions):
        assert part.partition == j
        assert part.device == "cpu"
        assert part.busy_s > 0
        assert part.busy_s + part.idle_s == pytest.approx(summary.span_s)
        assert part.bubble == pytest.approx(part.idle_s / summary.span_s)
    assert summary.bubble == pytest.approx(sum(p.bubble for p in summary.partitions) / N)
    text = str(summary)
    assert "bubble" in text and "in theory" in text
    assert len(text.splitlines()) == N + 3


def test_summary_of_a_synthetic_fill_drain() -> None:
    # Equal unit tasks in the fill-drain schedule give exactly the theoretical bubble.
    n, m = 4, 6
    timeline = Timeline(["cpu"] * n)
    timeline.microbatches.append(m)
    events = []
    for j in range(n):
        for i in range(m):
            events.append(TaskEvent(Phase.FORWARD, j, i, 0, i + j, i + j + 1, "t", "cpu", False))
            back = (n - 1 - j) + (m - 1 - i) + 100
            events.append(TaskEvent(Phase.BACKWARD, j, i, 0, back, back + 1, "t", "cpu", True))
    timeline._finish(events)
    summary = timeline.summary()
    assert summary.bubble == pytest.approx(theoretical_bubble(n, m))
    assert summary.bubble == pytest.approx(summary.theoretical_bubble)
    # The gap between the passes is not bubble.
    assert summary.span_s == pytest.approx(2 * (m + n - 1) / 1e9)


# -- Chrome trace ---------------------------------------------------------------------------

LABEL = re.compile(r"gpipe/(forward|recompute|backward|copy|loss)/p(\d+)/mb(\d+)")


def check_chrome_trace(data: dict[str, Any], partitions: int) -> None:
    """The documented format: metadata, complete events, paired flow events."""
    assert isinstance(data["traceEvents"], list)
    names = {}
    for e in data["traceEvents"]:
        assert e["ph"] in ("M", "X", "s", "f")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    for j in range(partitions):
        assert names[j].startswith(f"partition {j} (")
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    for e in complete:
        match = LABEL.fullmatch(e["name"])
        assert match is not None, e["name"]
        assert e["cat"] == match.group(1) == e["args"]["phase"]
        assert int(match.group(2)) == e["args"]["partition"]
        assert int(match.group(3)) == e["args"]["microbatch"]
        expected_tid = e["args"]["partition"] + (1000 if e["cat"] == "copy" else 0)
        assert e["tid"] == expected_tid and e["tid"] in names
        assert e["ts"] >= 0 and e["dur"] >= 0
    flows: dict[int, list[dict[str, Any]]] = {}
    for e in data["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], []).append(e)
    for pair in flows.values():
        assert [e["ph"] for e in pair] == ["s", "f"]
        assert pair[1]["bp"] == "e"
        assert pair[0]["cat"] == pair[1]["cat"] == "microbatch"


def test_chrome_trace_is_valid_json_in_the_documented_format(tmp_path: Path) -> None:
    timeline = traced_step(p3m4(), torch.randn(8, 8, requires_grad=True))
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == json.loads(json.dumps(timeline.chrome_trace()))
    check_chrome_trace(data, N)
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.events)
    # Arrows: micro-batch i from j to j + 1 in forward, back from j + 1 to j in backward.
    flows = [e for e in data["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == 2 * (N - 1) * M
    assert data["otherData"] == {"partitions": N, "microbatches": [M]}


# -- recording off changes nothing ----------------------------------------------------------


def marker_nodes(output: torch.Tensor) -> int:
    seen, stack, found = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += type(node).__name__.startswith("_Marker")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("checkpoint", MODES)
def test_recording_off_installs_nothing(checkpoint: str) -> None:
    model = p3m4(checkpoint)
    x = torch.randn(8, 8, requires_grad=True)
    with model.trace():
        traced = model(x)
    assert marker_nodes(traced) > 0  # the test can see markers
    assert marker_nodes(model(x)) == 0
    assert tracing._recorders == {}


def test_recording_stops_at_the_end_of_the_block() -> None:
    model = p3m4()
    x = torch.randn(8, 8, requires_grad=True)
    with model.trace() as timeline:
        output = model(x)
    # Backward after the block and later passes add nothing.
    output.sum().backward()
    model(x).sum().backward()
    assert timeline.microbatches == [M]
    assert keys(timeline, Phase.FORWARD) == ALL
    assert keys(timeline, Phase.BACKWARD) == []
    assert keys(timeline, Phase.RECOMPUTE) == []


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in model.parameters())]  # type: ignore[list-item]


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("checkpoint", MODES)
def test_recording_changes_no_result(checkpoint: str, input_requires_grad: bool) -> None:
    results = []
    for trace in (False, True, False):
        model = p3m4(checkpoint)
        torch.manual_seed(1)
        x = torch.randn(8, 8, requires_grad=input_requires_grad)
        if trace:
            with model.trace():
                output = model(x)
                output.sum().backward()
        else:
            output = model(x)
            output.sum().backward()
        results.append((output.detach(), output.requires_grad, x.grad, grads(model, x)[1:]))
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0])
        assert results[0][1] == other[1]
        assert (results[0][2] is None) == (other[2] is None)
        if other[2] is not None:
            assert torch.equal(results[0][2], other[2])
        for a, b in zip(results[0][3], other[3]):
            assert torch.equal(a, b)


KINDS = ("linear", "tanh", "relu_inplace", "identity")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
    partitions=st.integers(1, 3),
    chunks=st.integers(1, 4),
    batch=st.integers(1, 6),
    checkpoint=st.sampled_from(MODES),
    input_requires_grad=st.booleans(),
)
def test_traced_run_equals_plain(
    kinds: list[str],
    partitions: int,
    chunks: int,
    batch: int,
    checkpoint: str,
    input_requires_grad: bool,
) -> None:
    # A linear layer first, so that an in-place ReLU never modifies the user's input.
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(3, 3)]
    for kind in kinds:
        if kind == "linear":
            layers.append(nn.Linear(3, 3))
        elif kind == "tanh":
            layers.append(nn.Tanh())
        elif kind == "relu_inplace":
            layers.append(nn.ReLU(inplace=isinstance(layers[-1], nn.Linear)))
        else:
            layers.append(nn.Identity())
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(model)
    n = min(partitions, len(layers))
    balance = [len(layers) // n] * n
    balance[-1] += len(layers) - sum(balance)
    pipe = GPipe(model, balance, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(batch, 3, dtype=torch.float64)
    with pipe.trace() as timeline:
        assert_matches_plain(pipe, plain, x, input_requires_grad=input_requires_grad)
    assert keys(timeline, Phase.FORWARD) == sorted(
        (j, i) for j in range(n) for i in range(timeline.microbatches[0])
    )


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.detach() * 2  # the second output needs no gradient


def test_outputs_without_grad_stay_without_grad() -> None:
    torch.manual_seed(0)
    model = GPipe(nn.Sequential(nn.Linear(3, 3), Pair()), [1, 1], chunks=2, checkpoint="never")
    x = torch.randn(4, 3)
    with model.trace() as timeline:
        a, b = model(x)
        assert a.requires_grad and not b.requires_grad
        a.sum().backward()
    assert keys(timeline, Phase.BACKWARD) == [(0, 0), (0, 1), (1, 0), (1, 1)]


# -- errors and misuse ----------------------------------------------------------------------


def test_nested_trace_of_one_module_is_refused() -> None:
    model = p3m4()
    with model.trace(), pytest.raises(RuntimeError, match="already being traced"), model.trace():
        pass
    with model.trace() as timeline:  # usable again
        model(torch.randn(8, 8))
    assert len(timeline.events) == N * M


def test_events_are_refused_while_recording() -> None:
    model = p3m4()
    with model.trace() as timeline:
        assert timeline.recording
        with pytest.raises(RuntimeError, match="still being recorded"):
            timeline.summary()
    assert not timeline.recording
    assert "tasks" in repr(timeline)


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 3:
            raise ValueError("boom")
        return x


def test_error_in_a_traced_run() -> None:
    torch.manual_seed(0)
    model = GPipe(nn.Sequential(nn.Linear(4, 4), Boom()), [1, 1], chunks=2)
    with pytest.raises(ValueError, match="boom"), model.trace() as timeline:
        model(torch.randn(6, 4))
    assert not timeline.recording
    assert tracing._recorders == {}
    with model.trace() as timeline:
        model(torch.randn(4, 4)).sum().backward()
    assert keys(timeline, Phase.BACKWARD) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_nested_gpipes_traced_together() -> None:
    torch.manual_seed(0)
    inner = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), [1, 1], chunks=2)
    outer = GPipe(nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 4)), [1, 1, 1], chunks=2)
    with outer.trace() as outer_timeline, inner.trace() as inner_timeline:
        outer(torch.randn(4, 4)).sum().backward()
    everything = sorted((j, i) for j in range(3) for i in range(2))
    assert keys(outer_timeline, Phase.FORWARD) == everything
    assert keys(outer_timeline, Phase.BACKWARD) == everything
    assert keys(outer_timeline, Phase.RECOMPUTE) == [(0, 0), (1, 0), (2, 0)]
    # The inner pipeline runs for outer micro-batch 0 (checkpointed: no grad, forward only),
    # for micro-batch 1, and again when micro-batch 0 is recomputed. Its own checkpoint
    # phase inside the outer recomputation is a forward task, not a recomputation.
    assert inner_timeline.microbatches == [2, 2, 2]
    tasks = Counter((e.run, e.phase) for e in inner_timeline.events)
    assert tasks == {
        (0, Phase.FORWARD): 4,
        **{(run, Phase.FORWARD): 4 for run in (1, 2)},
        **{(run, Phase.BACKWARD): 4 for run in (1, 2)},
        **{(run, Phase.RECOMPUTE): 2 for run in (1, 2)},
    }


def test_traced_module_can_be_collected() -> None:
    model = p3m4()
    with model.trace() as timeline:
        model(torch.randn(8, 8)).sum().backward()
    del model
    gc.collect()
    assert tracing._recorders == {}
    assert len(timeline.events) == 2 * N * M + N * (M - 1)


# -- copies (one device here, so the tracer is driven directly) -----------------------------


def test_copy_is_recorded_both_ways() -> None:
    from gpipe_core._stream import CPUStream
    from gpipe_core.transport._transfer import copy
    from gpipe_microbatch import Batch

    owner = object()
    with tracing.record(owner, [torch.device("cpu")] * 2) as timeline:
        tracer = tracing.tracer_for(owner, 1)
        assert tracer is not None
        x = torch.randn(2, 3, requires_grad=True)
        batch = Batch(x)
        tracer.copy(
            lambda: copy(batch, CPUStream, CPUStream), batch, 0, 1, CPUStream, CPUStream,
            torch.device("cpu"),
        )  # fmt: skip
        batch.tensor.sum().backward()
    assert x.grad is not None
    copies = [e for e in timeline.events if e.phase is Phase.COPY]
    assert [(e.partition, e.microbatch, e.backward) for e in copies] == [
        (1, 0, False),
        (1, 0, True),
    ]
    data = timeline.chrome_trace()
    names = [e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"]
    assert "partition 1 copies" in names
    check_chrome_trace(data, 2)


@pytest.mark.parametrize(
    ("last", "copied"),
    [
        ("cpu:0", False),  # "cpu" and "cpu:0" are one device, as for tensors: no copies
        pytest.param(
            "cuda:0",
            True,
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_copies_are_recorded(checkpoint: str, last: str, copied: bool) -> None:
    # Partition 2 on "last", the others on the CPU. (On one device, the tracer's copy is
    # driven directly: test_copy_is_recorded_both_ways.)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), nn.Linear(4, 4), Pop())
    plain = copy.deepcopy(layers)
    model = GPipe(layers, [2, 2, 1], devices=["cpu", "cpu", last], chunks=2, checkpoint=checkpoint)
    assert [(r.stash_partition, r.pop_partition) for r in model.skip_layout.routes] == [(0, 2)]
    with model.trace() as timeline:
        assert_matches_plain(model, plain, torch.randn(4, 4), weighted=True)
    copies = Counter((e.partition, e.microbatch, e.backward) for e in timeline.events
                     if e.phase is Phase.COPY)  # fmt: skip
    # On another device: into partition 2, for each micro-batch and both ways, its input
    # from partition 1 and the skip from partition 0.
    expected = {(2, i, backward): 2 for i in range(2) for backward in (False, True)}
    assert copies == (expected if copied else {})


def test_cuda_stamps_are_put_on_the_host_clock() -> None:
    class FakeEvent:
        def elapsed_time(self, other: object) -> float:
            return 0.0025 if other == "event" else 0.0  # milliseconds

    recorder = tracing._Recorder([torch.device("cpu")])
    recorder.references[3] = (FakeEvent(), recorder.origin + 1000)  # type: ignore[dict-item]
    assert recorder._resolve(("event", 3)) == 1000 + 2500  # type: ignore[arg-type]
    assert recorder._resolve(recorder.origin + 7) == 7


# -- torch.profiler labels ------------------------------------------------------------------


def profiled_labels(model: GPipe, **kwargs: Any) -> set[str]:
    x = torch.randn(8, 8)
    model(x).sum().backward()  # start the workers outside the profile
    with torch.profiler.profile(**kwargs) as prof:
        model(x).sum().backward()
    return {e.name for e in prof.events() if e.name.startswith("gpipe/")}


def expected_labels(phases: tuple[Phase, ...], stop: int) -> set[str]:
    return {
        task_label(phase, j, i)
        for phase in phases
        for j, i in ALL
        if phase is not Phase.RECOMPUTE or i < stop
    }


def test_profiler_of_all_threads_sees_every_task() -> None:
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    labels = profiled_labels(p3m4(), experimental_config=config)
    phases = (Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD)
    assert labels == expected_labels(phases, M - 1)


def test_plain_profiler_sees_autograd_tasks_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_warned", False)
    # The workers run the forward tasks (as where some action is long): not one turn.
    monkeypatch.setattr(Turns, "one_turn", lambda self, actions: False)
    with pytest.warns(UserWarning, match="profile_all_threads"):
        labels = profiled_labels(p3m4())
    assert labels == expected_labels((Phase.RECOMPUTE, Phase.BACKWARD), M - 1)


def test_plain_profiler_sees_a_run_in_one_turn_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every action short (as measured by a run): the calling thread runs them all.
    monkeypatch.setattr(tracing, "_warned", False)
    model, x = p3m4(), torch.randn(8, 8)
    model(x).sum().backward()  # on the workers, measuring every action
    measured_short(model)  # as they are, but for a first-time cost's hiccup
    with warnings.catch_warnings(), torch.profiler.profile() as prof:
        warnings.simplefilter("error")
        model(x).sum().backward()
    labels = {e.name for e in prof.events() if e.name.startswith("gpipe/")}
    phases = (Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD)
    assert labels == expected_labels(phases, M - 1)


def test_profiler_and_trace_together() -> None:
    model = p3m4()
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(experimental_config=config) as prof, model.trace() as timeline:
        model(torch.randn(8, 8)).sum().backward()
    labels = {e.name for e in prof.events() if e.name.startswith("gpipe/")}
    assert labels == {e.label for e in timeline.events}


# -- plot -----------------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    timeline = traced_step(p3m4(), torch.randn(8, 8))
    path = tmp_path / "timeline.png"
    figure = timeline.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = figure.axes[0]
    assert len(ax.patches) == len(timeline.events)  # one bar per task
    # Bars wide enough to hold it carry their micro-batch.
    texts = {t.get_text() for t in ax.texts}
    assert texts and texts <= {str(i) for i in range(M)}
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"partition {j}\ncpu" for j in range(N)]


def test_plot_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    timeline = traced_step(p3m4(), torch.randn(8, 8))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(ImportError, match=re.escape('dist/gpipe_microbatch-*.whl "gpipe[plot]"')):
        timeline.plot()


# -- CUDA -----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"]])
def test_cuda_times_are_resolved_after_the_block(devices: list[str], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPipe(
        nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)),
        [2, 1],
        devices=devices,
        chunks=4,
    )
    x = torch.randn(64, 256, device=devices[0], requires_grad=True)
    model(x).sum().backward()
    with model.trace() as timeline:
        model(x).sum().backward()
    copies = 4 * 2 if devices[0] != devices[1] else 0
    assert len(timeline.events) == 2 * 2 * 4 + 2 * 3 + copies
    assert {e.device for e in timeline.events if e.partition == 1} == {"cuda:0"}
    forward = by_task(timeline, Phase.FORWARD)
    for (j, i), task in forward.items():
        assert task.end_ns >= task.start_ns >= 0
        if j > 0:
            assert task.start_ns >= forward[j - 1, i].end_ns - 50_000  # clock alignment slack
    timeline.to_chrome_trace(tmp_path / "trace.json")
    check_chrome_trace(json.loads((tmp_path / "trace.json").read_text()), 2)


@pytest.mark.parametrize(
    ("balance", "chunks", "batch", "head"),
    [
        ([1], 1, 2, "timeline: 1 partition, 1 forward pass of 1 micro-batch, "),
        ([1, 1], 4, 8, "timeline: 2 partitions, 1 forward pass of 4 micro-batches, "),
    ],
)
def test_summary_counts_in_words(balance: list[int], chunks: int, batch: int, head: str) -> None:
    pipe = GPipe(nn.Sequential(*[nn.Linear(2, 2) for _ in balance]), balance, chunks=chunks)
    with pipe.trace() as timeline:
        pipe(torch.randn(batch, 2))
    assert str(timeline.summary()).startswith(head)
