"""Interleaved and zero-bubble schedules: several partitions per worker, against their
analysis, gpipe's own 1F1B and torch.distributed.pipelining.

Run it as a script (``python benchmarks/bench_schedules.py``, ``--quick`` for a short
run), or with ``nox -s bench``. On the CPU, each process with one intra-op thread
(``torch.set_num_threads(1)``, or ``--threads``), one training step (forward, loss and
backward of the whole batch) is timed these ways, interleaved round by round (each way
goes first in turn) so that the machine's load affects them alike. Each schedule runs
with its placement: ``gpipe`` and ``1f1b`` with one partition per worker (the two
partitions of a worker merged into one), ``interleaved-1f1b`` and ``zb-h1`` with
``placement="loop"``, ``zbv`` with ``placement="v"``, two partitions per worker:

- ``step <schedule>``: ``GPipe.step`` in this process, one worker per ``"cpu"`` entry of
  ``devices``;
- ``dist <schedule>``: ``GPipe(..., group=WORLD).step`` on every rank of a gloo group, one
  process per worker (``torch.multiprocessing`` spawn, 127.0.0.1), timed from a barrier to
  the last rank's end;
- ``pipe <schedule>``: ``torch.distributed.pipelining``'s class of the same schedule
  (``Schedule1F1B`` on one stage per rank, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` on two stages per rank,
  placed as gpipe's), in the same processes as the ``dist`` ways;
- ``plain mb``: the ``nn.Sequential`` on the micro-batches, one after the other, in this
  process.

Tables:

1. **Fixed-time partitions**, 2 and 4 workers, 2 partitions per worker, M8, in one process
   and across processes: each partition's forward pass, input gradient and weight
   gradient take ``t`` each (10 ms, half the other scripts' ``t``: the steps last 49 to
   66 ``t``; calibrated sleeps as theirs: an autograd function on the input path
   sleeps ``t`` in its forward and ``t`` in its backward, the input gradient ``I``; one on
   the parameter's path sleeps ``t`` in its backward, the weight gradient ``W``; the
   input requires grad, so that the first partition's ``I`` takes ``t`` too). Each
   schedule against its own ideal: :func:`~gpipe_core.simulate`'s makespan of its action
   lists with those durations, in units of ``t``. Targets: at most 1.03 in one process,
   1.05 across processes; and the measured ordering of the analysis, ``zbv < zb-h1 <
   interleaved-1f1b < 1f1b``, as one line per neighbouring pair (each pair's ratio at
   most 1, with :func:`~gpipe_core.simulate`'s ratio beside it). ``plain mb`` runs the
   ``3 n m`` actions one after the other: its time over ``3 n m t`` checks the sleep's
   calibration (about 1.00).
2. **Compute-bound models**, 2 processes, 4 partitions (2 per rank): the transformer-block
   stack at M4 and M8 and the MLP at M8 (the models of ``bench_distributed.py``, split
   finer). Each ``dist`` way against gpipe's own 1F1B (``dist 1f1b``, same processes, same
   run) and against pipelining's same schedule, and every way over the bound ``plain mb /
   2``: the micro-batches' work shared evenly by the 2 processes, with no idle time.
   Targets on the transformer at M4: ``zbv`` at most 0.93 x gpipe's 1F1B,
   ``interleaved-1f1b`` and ``zb-h1`` at most gpipe's 1F1B; every schedule at most
   pipelining's same schedule, on every case.
3. **Memory**, in one process, 2 and 4 workers, an MLP of two (``ReLU``, ``Linear``)
   layers per partition, M8: the peak bytes of the tensors saved for backward on each
   worker (counted by saved-tensor hooks, each storage once, for the worker thread that
   saved it; parameters, input and target not counted), against two bounds: what the
   schedule's action list holds at most (a partition's micro-batch from its ``F`` to its
   ``B`` or ``W``, at the plain layers' saved bytes on one micro-batch, the loss's on the
   last partition), and 1F1B's peak (one partition per worker), which ``zb-h1`` and
   ``zbv`` promise to keep. Targets: every schedule at most its list's bound, ``zb-h1``
   and ``zbv`` at most 1F1B's peak. Each partition starts with a ``ReLU``, on the input's
   path only: what it saves (its result, which the ``Linear`` after it saves too) is
   needed by ``I`` and not by ``W``.

Times are medians, after two warm-up steps per way. The targets are printed at the end as
PASS or FAIL lines; a FAIL does not change the exit status (a loaded machine can fail a
timing), but a way that fails to run (it raises, or a rank raises, dies or does not answer
in time) is listed and makes the script exit 1 after printing what it measured; the other
ways still run. Every wait for another process is bounded, and every process is ended and
reaped, also on failure. Only ratios within one run are meaningful.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import itertools

from _step_models import (
    Case,
    Check,
    SavedBytes,
    Sizes,
    Ways,
    add_selection,
    bench_parser,
    calibrated_sleep,
    describe_sleep,
    finish,
    measure,
    ms,
    parallel_speedup,
    parse_bench,
    parse_way,
    per_microbatch_bytes,
    placed_balance,
    print_table,
    print_unrun,
    split_sleep_case,
    step_models,
)
from gpipe_core import get_schedule, simulate

#: The schedules, and the placement each runs with (None: one partition per worker).
PLACEMENTS: dict[str, str | None] = {
    "gpipe": None,
    "1f1b": None,
    "interleaved-1f1b": "loop",
    "zb-h1": "loop",
    "zbv": "v",
}
SCHEDULES = tuple(PLACEMENTS)
#: The compute-bound cases' schedules (gpipe's fill-drain left out).
COMPUTE_SCHEDULES = SCHEDULES[1:]
#: The schedules whose memory is bounded by 1F1B's peak.
ZERO_BUBBLE = ("zb-h1", "zbv")
#: The analysis's ordering of the step times, fastest first.
ORDER = ("zbv", "zb-h1", "interleaved-1f1b", "1f1b")
TABLES = ("fixed-time", "compute", "memory")
#: The compute-bound case with targets against gpipe's 1F1B.
SPEED_TARGETS_CASE = "transformer P4 M4"
#: Seconds any wait for a rank may last (a step, the start of the processes).
TIMEOUT = 120.0


def way(kind: str, schedule: str) -> str:
    """The way that runs ``schedule`` with its placement: ``way('dist', 'zbv') == 'dist zbv v'``."""
    placement = PLACEMENTS[schedule]
    return f"{kind} {schedule}" + ("" if placement is None else f" {placement}")


def label(schedule: str) -> str:
    """A schedule with its placement, as a column header: ``'zbv v'``."""
    return way("-", schedule)[2:]


def ideal_units(case: Case, schedule: str, workers: int) -> int:
    """:func:`~gpipe_core.simulate`'s makespan of ``schedule`` on ``case``'s fixed-time
    partitions (``F``, ``I`` and ``W`` of one unit each), in units of ``t``."""
    balance, where = placed_balance(case, parse_way(way("step", schedule)), workers)
    k = len(case.balance) // len(balance)  # the case's partitions in one of the way's
    lists = get_schedule(schedule).worker_actions(case.chunks, len(balance), where)
    units = dict.fromkeys(("forward", "input", "weight"), k)
    return len(simulate(lists, units, placement=where)[0])


# --------------------------------------------------------------------------------------------
# 1. Fixed-time partitions
# --------------------------------------------------------------------------------------------


def print_fixed_time(
    cases: Sequence[tuple[Case, int]], results: dict[str, dict[str, Any]], t: float
) -> list[Check]:
    """The fixed-time table, the measured orderings, and their targets."""
    rows, orderings, checks = [], [], []
    for case, workers in cases:
        r = results.get(case.name, {})
        units = {s: ideal_units(case, s, workers) for s in SCHEDULES}
        serial = r.get("plain mb")
        actions = 3 * len(case.balance) * case.chunks
        stage = f"{serial / (actions * t):.3f}" if isinstance(serial, float) else "-"
        rows.append([case.name, "simulate, t", *(str(units[s]) for s in SCHEDULES)])
        rows.append([f"  (stage/t {stage})", "ideal ms", *(ms(units[s] * t) for s in SCHEDULES)])
        for kind, limit in (("step", 1.03), ("dist", 1.05)):
            values = {s: r.get(way(kind, s)) for s in SCHEDULES}
            ratios = {
                s: v / (units[s] * t) if isinstance(v, float) else None for s, v in values.items()
            }
            rows.append(
                [
                    "",
                    f"{kind} / ideal",
                    *(f"{x:.3f}" if x is not None else "-" for x in ratios.values()),
                ]
            )
            for s in SCHEDULES:
                checks.append(
                    (f"{case.name}: {way(kind, s)} / simulate <= {limit:g}", ratios[s], limit)
                )
            measured = {s: values[s] for s in ORDER if isinstance(values[s], float)}
            if measured:
                order = sorted(measured, key=lambda s: measured[s])
                orderings.append(
                    f"  {case.name} {kind}: "
                    + " < ".join(f"{s} {ms(measured[s])}" for s in order)
                    + f" ms; simulate: {', '.join(f'{s} {units[s]}' for s in ORDER)} t"
                )
            for faster, slower in itertools.pairwise(ORDER):
                a, b = values[faster], values[slower]
                ratio = a / b if isinstance(a, float) and isinstance(b, float) else None
                checks.append(
                    (
                        f"{case.name}: {way(kind, faster)} / {way(kind, slower)} <= 1 (ordering; "
                        f"simulate {units[faster]}/{units[slower]} = "
                        f"{units[faster] / units[slower]:.3f})",
                        ratio,
                        1.0,
                    )
                )
    if rows:
        print(
            "Fixed-time partitions (F, I, W of t each), M8: each schedule's simulate makespan "
            "in t, and each way over it (stage/t: plain mb / 3 n m t, the calibration check)"
        )
        print_table(["case", "", *(label(s) for s in SCHEDULES)], rows, first=22)
        print("Measured ordering (the analysis: zbv < zb-h1 < interleaved-1f1b < 1f1b)")
        for line in orderings:
            print(line)
        print()
    return checks


# --------------------------------------------------------------------------------------------
# 2. Compute-bound models
# --------------------------------------------------------------------------------------------


def compute_cases(sizes: Sizes) -> list[Case]:
    """The transformer-block stack at M4 and M8, the MLP at M8: 4 partitions each."""
    transformer = Case(
        "transformer P4 M4",
        "transformer",
        {"d_model": sizes.d_model, "heads": 4, "layers": 4},
        [1, 1, 1, 1],
        4,
        (sizes.tokens_batch, sizes.seq, sizes.d_model),
        "mse",
    )
    return [
        transformer,
        replace(transformer, name="transformer P4 M8", chunks=8),
        Case(
            "MLP P4 M8",
            "mlp",
            {"n": 4, "width": sizes.width, "layers_per_partition": 2},
            [2, 2, 2, 2],
            8,
            (sizes.batch, sizes.width),
            "mse",
        ),
    ]


def compute_ways() -> list[str]:
    return [
        "plain mb",
        *(way("dist", s) for s in COMPUTE_SCHEDULES),
        *(way("pipe", s) for s in COMPUTE_SCHEDULES),
    ]


def print_compute(
    cases: Sequence[Case], results: dict[str, dict[str, Any]], workers: int
) -> list[Check]:
    """The compute-bound tables and their targets."""
    bound_rows, versus_rows, checks = [], [], []
    names = compute_ways()[1:]
    for case in cases:
        r = results.get(case.name)
        if r is None:
            continue
        serial = r.get("plain mb")
        bound = serial / workers if isinstance(serial, float) else None
        bound_rows.append(
            [
                case.name,
                "-" if bound is None else ms(bound),
                *(
                    f"{r[n] / bound:.3f}" if bound and isinstance(r.get(n), float) else "-"
                    for n in names
                ),
            ]
        )

        def ratio(a: str, b: str, r: dict[str, Any] = r) -> float | None:
            x, y = r.get(a), r.get(b)
            return x / y if isinstance(x, float) and isinstance(y, float) else None

        row = [case.name]
        for s in COMPUTE_SCHEDULES:
            to_1f1b = ratio(way("dist", s), "dist 1f1b")
            to_pipe = ratio(way("dist", s), way("pipe", s))
            if s != "1f1b":
                row.append("-" if to_1f1b is None else f"{to_1f1b:.3f}")
            row.append("-" if to_pipe is None else f"{to_pipe:.3f}")
            checks.append((f"{case.name}: {way('dist', s)} / {way('pipe', s)} <= 1", to_pipe, 1.0))
        versus_rows.append(row)
        if case.name == SPEED_TARGETS_CASE:
            for s, limit in (("zbv", 0.93), ("zb-h1", 1.0), ("interleaved-1f1b", 1.0)):
                checks.append(
                    (
                        f"{case.name}: {way('dist', s)} / dist 1f1b <= {limit:g}",
                        ratio(way("dist", s), "dist 1f1b"),
                        limit,
                    )
                )
    if bound_rows:
        print(
            f"Compute-bound models, {workers} processes, 4 partitions: each way over the bound "
            f"plain mb / {workers} (the micro-batches' work shared evenly, no idle; lower is "
            "better, 1.00 at best)"
        )
        print_table(["case", "bound ms", *names], bound_rows)
        print()
        header = ["case"]
        for s in COMPUTE_SCHEDULES:
            if s != "1f1b":
                header.append(f"{s} / 1f1b")
            header.append(f"{s} / pipe")
        print(
            "gpipe across processes: each schedule over gpipe's 1F1B (dist 1f1b, one partition "
            "per rank) and over pipelining's same schedule (lower is better)"
        )
        print_table(header, versus_rows)
        print()
    return checks


# --------------------------------------------------------------------------------------------
# 3. Memory
# --------------------------------------------------------------------------------------------


def memory_case(workers: int, width: int) -> Case:
    """An MLP of two (ReLU, Linear) layers per partition, two partitions per worker, M8:
    no tensor saved for backward by one partition is saved by the next one too."""
    return Case(
        f"MLP W{workers} M8",
        "mlp",
        {"n": 2 * workers, "width": width, "relu_first": True},
        [2] * (2 * workers),
        8,
        (64, width),
        "mse",
    )


def list_bound(schedule: str, case: Case, workers: int, per_partition: Sequence[int]) -> list[int]:
    """The most bytes each worker's action list holds: a partition's micro-batch from its
    ``F`` to its ``B`` or ``W``, ``per_partition[j]`` bytes on partition ``j``."""
    balance, where = placed_balance(case, parse_way(way("step", schedule)), workers)
    k = len(case.balance) // len(balance)
    sizes = [sum(per_partition[j * k : (j + 1) * k]) for j in range(len(balance))]
    peaks = []
    for w, actions in enumerate(
        get_schedule(schedule).worker_actions(case.chunks, len(balance), where)
    ):
        held = peak = 0
        for action in actions:
            j = w if action.partition is None else action.partition
            if action.kind == "forward":
                held += sizes[j]
            elif action.kind in ("backward", "weight"):
                held -= sizes[j]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def memory(workers: int, width: int) -> tuple[list[list[str]], list[Check]]:
    """The memory table's rows of ``workers`` workers, and their targets."""
    case = memory_case(workers, width)
    per_partition = per_microbatch_bytes(case, loss=True)
    x, y = case.data()
    loss_fn = case.loss_fn()
    models = step_models(case, [way("step", s) for s in SCHEDULES], workers)
    one_f_one_b = max(list_bound("1f1b", case, workers, per_partition))
    rows, checks = [], []
    for schedule in SCHEDULES:
        model, _ = models[way("step", schedule)]
        counter = SavedBytes([*model.parameters(), x, y])
        with counter.hooks():
            model.step(x, y, loss_fn, schedule=schedule)
        peaks = [counter.peak_by.get(f"gpipe-worker-{w}", 0) for w in range(workers)]
        other = sum(
            v for name, v in counter.peak_by.items() if not name.startswith("gpipe-worker-")
        )
        own = list_bound(schedule, case, workers, per_partition)
        to_own = max(p / b for p, b in zip(peaks, own, strict=True))
        to_1f1b = max(peaks) / one_f_one_b
        rows.append(
            [
                f"{case.name} {label(schedule)}",
                "/".join(f"{p / 1024:.0f}" for p in peaks),
                "/".join(f"{b / 1024:.0f}" for b in own),
                f"{one_f_one_b / 1024:.0f}",
                f"{other / 1024:.0f}",
                f"{to_own:.3f}",
                f"{to_1f1b:.3f}",
            ]
        )
        checks.append(
            (f"{case.name}: {way('step', schedule)} peak / its list's bound <= 1", to_own, 1.0)
        )
        if schedule in ZERO_BUBBLE:
            checks.append(
                (f"{case.name}: {way('step', schedule)} peak / 1F1B's peak <= 1", to_1f1b, 1.0)
            )
    return rows, checks


def print_memory(sizes: Sequence[int], width: int) -> list[Check]:
    rows, checks = [], []
    for workers in sizes:
        more_rows, more_checks = memory(workers, width)
        rows += more_rows
        checks += more_checks
    case = memory_case(sizes[0], width)
    losses = per_microbatch_bytes(case, loss=True)[-1] - per_microbatch_bytes(case)[-1]
    print(
        f"Saved-activation bytes per worker (KiB), in one process: MLP of (ReLU, Linear({width}, "
        f"{width})) x 2 per partition, 2 partitions per worker, 8 rows per micro-batch, M8: "
        "each worker's peak; the most its action list holds (a partition's micro-batch from F "
        "to B or W); 1F1B's peak (one partition per worker: the bound of zb-h1 and zbv); what "
        "other threads saved; the largest peak over its worker's list bound, the largest peak "
        "over 1F1B's"
    )
    print_table(
        ["case", "peak", "list bound", "1F1B peak", "other", "/ list", "/ 1F1B"], rows, first=26
    )
    print(
        f"  the loss saves {losses / 1024:.0f} KiB of one micro-batch on the last partition's "
        "worker (in the list bound from F to W; freed at I): 1F1B holds it on a worker with "
        "fewer micro-batches, zb-h1 and zbv beside 1F1B's first worker's count"
    )
    print()
    return checks


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    began = time.perf_counter()
    parser = bench_parser(__doc__)
    add_selection(parser, "tables", TABLES)
    args, rounds, sizes, chosen = parse_bench(parser, argv, ("tables", TABLES))
    torch.set_num_threads(args.threads)

    print(
        f"Interleaved and zero-bubble schedules: CPU, torch {torch.__version__}, intra-op "
        f"threads {torch.get_num_threads()} per process (torch.set_num_threads({args.threads})), "
        f"{os.cpu_count()} cores, {rounds} rounds (medians), ways interleaved"
    )
    print(
        "  placements: gpipe and 1f1b one partition per worker (a worker's two merged), "
        "interleaved-1f1b and zb-h1 loop, zbv v"
    )
    if "compute" in chosen:
        print(f"  {sizes.describe(('MLP', 'transformer'))}, split in 4 partitions")
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"  load average {load}; two threads run {parallel_speedup():.2f}x as fast as one on "
        "independent matmuls (2.00 on two idle cores; less when other processes use them)"
    )
    # Half the other scripts' t: the steps last 49 to 66 t (1F1B on 4 workers), and the
    # table runs 11 ways on 2 cases.
    t = sizes.sleep / 2
    sleep = t
    if "fixed-time" in chosen:
        sleep, alone = calibrated_sleep(t)
        print(f"  {describe_sleep(t, sleep, alone)}")
    print()

    # Each case with its ways, workers and rounds: fixed-time steps are long.
    fixed = (
        [(split_sleep_case(w, 8, t, sleep), w) for w in (2, 4)] if "fixed-time" in chosen else []
    )
    computed = compute_cases(sizes) if "compute" in chosen else []
    plan: list[tuple[Case, list[str], int, int]] = []
    for case, workers in fixed:
        names = ["plain mb", *(way(kind, s) for kind in ("step", "dist") for s in SCHEDULES)]
        plan.append((case, names, workers, max(2, rounds // 2)))
    for case in computed:
        plan.append((case, compute_ways(), 2, rounds))

    ways = Ways(args.threads, TIMEOUT)
    results: dict[str, dict[str, Any]] = {}
    try:
        for case, names, workers, case_rounds in plan:
            results[case.name] = measure(ways.build(case, names, workers), case_rounds)
            ways.close()
            elapsed = time.perf_counter() - began
            print(f"  measured {case.name} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
    finally:
        ways.close()

    checks: list[Check] = []
    checks += print_fixed_time(fixed, results, t)
    checks += print_compute(computed, results, 2)
    if "memory" in chosen:
        try:
            checks += print_memory((2, 4), 256)
        except Exception as error:
            results["memory"] = {"step": f"failed: {type(error).__name__}: {error}"}

    problems = {
        f"{case_name}: {name}": value
        for case_name, r in results.items()
        for name, value in r.items()
        if isinstance(value, str)
    }
    print_unrun(problems)

    return finish(checks, problems, ways, f"; {time.perf_counter() - began:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
