"""What ``model.trace()`` records of a GPipe.step: every task, in each schedule's order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from core_support.models import MODES
from gpipe_core import Action, GPipe, Phase, Timeline, get_schedule, task_label
from gpipe_core.trace import _tracing as tracing

N, M = 3, 5
STOPS = {"always": M, "except_last": M - 1, "never": 0}


def traced_step(checkpoint: str, schedule: str) -> Timeline:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6) if k % 2 == 0 else nn.Tanh() for k in range(2 * N)]
    model = GPipe(nn.Sequential(*layers), [2] * N, chunks=M, checkpoint=checkpoint)
    x, y = torch.randn(10, 6), torch.randn(10, 6)
    with model.trace() as timeline:
        model.step(x, y, nn.MSELoss(), schedule=schedule)
    return timeline


def on_partition(timeline: Timeline, j: int) -> list[tuple[Phase, int]]:
    events = sorted(
        (e for e in timeline.events if e.partition == j and e.phase is not Phase.COPY),
        key=lambda e: (e.start_ns, e.end_ns),
    )
    return [(e.phase, e.microbatch) for e in events]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_step_records_its_tasks_in_the_schedule_order(checkpoint: str, schedule: str) -> None:
    timeline = traced_step(checkpoint, schedule)
    stop = STOPS[checkpoint]
    everything = sorted((j, i) for j in range(N) for i in range(M))

    def tasks(phase: Phase) -> list[tuple[int, int]]:
        return sorted((e.partition, e.microbatch) for e in timeline.events if e.phase is phase)

    assert tasks(Phase.FORWARD) == everything
    assert tasks(Phase.BACKWARD) == everything
    assert tasks(Phase.RECOMPUTE) == [(j, i) for j, i in everything if i < stop]
    # The loss is its own task, once per micro-batch: after the forward pass, or after the
    # recomputation of a checkpointed micro-batch.
    assert tasks(Phase.LOSS) == [(N - 1, i) for i in range(M)]
    assert tasks(Phase.COPY) == []  # one device

    for e in timeline.events:
        assert e.end_ns >= e.start_ns >= 0
        assert e.backward == (e.phase in (Phase.RECOMPUTE, Phase.BACKWARD))
        assert e.thread == f"gpipe-worker-{e.partition}"

    actions = get_schedule(schedule).actions(M, N)
    for j in range(N):
        order = on_partition(timeline, j)
        kinds = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward"}
        recorded = [Action(kinds[p], i) for p, i in order if p in kinds]  # type: ignore[arg-type]
        assert recorded == actions[j], f"partition {j}"
        # A recomputation runs right before its backward pass (on the last partition, with
        # the micro-batch's loss in between); a loss right after its forward pass, or after
        # its recomputation when the micro-batch is checkpointed.
        last = j == N - 1
        for k, (phase, i) in enumerate(order):
            if phase is Phase.RECOMPUTE:
                if last:
                    assert order[k + 1 : k + 3] == [(Phase.LOSS, i), (Phase.BACKWARD, i)]
                else:
                    assert order[k + 1] == (Phase.BACKWARD, i)
            if phase is Phase.BACKWARD and i < stop:
                assert order[k - 2 if last else k - 1] == (Phase.RECOMPUTE, i)
            if phase is Phase.LOSS:
                assert last
                assert order[k - 1] == (Phase.RECOMPUTE if i < stop else Phase.FORWARD, i)


def test_schedules_differ_in_the_recorded_order() -> None:
    gpipe = on_partition(traced_step("never", "gpipe"), 0)
    one_f_one_b = on_partition(traced_step("never", "1f1b"), 0)
    assert sorted(gpipe) == sorted(one_f_one_b)
    assert gpipe != one_f_one_b


def profiled_step_labels(**profile: Any) -> set[str]:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6) if k % 2 == 0 else nn.Tanh() for k in range(2 * N)]
    model = GPipe(nn.Sequential(*layers), [2] * N, chunks=M, checkpoint="except_last")
    x, y = torch.randn(10, 6), torch.randn(10, 6)
    with torch.profiler.profile(**profile) as prof:
        model.step(x, y, nn.MSELoss(), schedule="1f1b")
    return {e.name for e in prof.events() if e.name.startswith("gpipe/")}


def test_profiler_of_all_threads_sees_every_step_task() -> None:
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    labels = profiled_step_labels(experimental_config=config)
    everything = [(j, i) for j in range(N) for i in range(M)]
    expected = {task_label(Phase.FORWARD, j, i) for j, i in everything}
    expected |= {task_label(Phase.BACKWARD, j, i) for j, i in everything}
    expected |= {task_label(Phase.RECOMPUTE, j, i) for j, i in everything if i < M - 1}
    expected |= {task_label(Phase.LOSS, N - 1, i) for i in range(M)}
    assert labels == expected


def test_plain_profiler_warns_that_it_misses_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every task of a step runs on a worker thread: a profiler of the calling thread alone
    # records none of them. It should say so, as it does for forward().
    monkeypatch.setattr(tracing, "_warned", False)
    with pytest.warns(UserWarning, match="profile_all_threads"):
        labels = profiled_step_labels()
    assert labels == set()
