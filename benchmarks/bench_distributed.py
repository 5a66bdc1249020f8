"""Stages across processes: gpipe's ``group=`` side by side with torch.distributed.pipelining.

Run it as a script (``python benchmarks/bench_distributed.py``, ``--quick`` for a short
run), or with ``nox -s bench``. On the CPU, each process with one intra-op thread
(``torch.set_num_threads(1)``), one training step (forward, loss and backward of the whole
batch) is timed these ways, interleaved round by round (each way goes first in turn) so
that the machine's load affects them alike:

- ``plain``: the ``nn.Sequential`` itself on the whole batch, in this process;
- ``plain mb`` (fixed-time cases only): the same on the micro-batches, one after the other;
- ``step gpipe`` and ``step 1f1b``: ``GPipe.step`` in this process, each schedule (one
  worker thread per partition);
- ``dist gpipe`` and ``dist 1f1b``: ``GPipe(..., group=WORLD).step`` called on every rank
  of a gloo group, one process (and one stage) per rank;
- ``pipe gpipe`` and ``pipe 1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe``
  and ``Schedule1F1B`` on a ``PipelineStage`` per rank, in the same processes.

The ``dist`` and ``pipe`` ways of a case run in the same processes (started by this script,
``torch.multiprocessing`` spawn, gloo on 127.0.0.1); a step starts on every rank after a
barrier and is timed from there to the last rank's end. Cases (the models of
``bench_step.py``, no checkpointing):

- fixed-time stages at 2 and 4 processes, M8: each partition is an autograd function whose
  forward and backward each take ``t`` (a sleep, releasing the GIL), so the ideal step
  takes ``2 (m + n - 1) t``; ratios are to that ideal (4 processes on 2 cores work: the
  sleeps free the cores). The sleep is calibrated first, in this process, so that a stage
  takes ``t`` here (as in ``bench_step.py``); ``plain mb`` (the stages on the micro-batches
  one after the other, in this process) checks it in the same run, and a second table shows
  each way against the ideal scaled by it;
- an MLP and a transformer-block stack at 2 processes, M4: ratios to ``plain``, and gpipe's
  ``dist`` ways relative to pipelining's with the same schedule;
- a tiny model (one ``Linear(4, 4)`` per partition) at 2 processes, M32: the overhead per
  task, ``(time - plain) / (n * m)`` in microseconds;
- pipelines on a device mesh at 4 processes (``_mesh_bench.py``): a transformer of 8 layers
  in ``pp4``, ``pp2 x dp_replicate2`` and ``pp2 x dp_shard2`` (FSDP2), against
  ``torch.distributed.pipelining`` with each stage ``fully_shard``-ed on the same mesh: the
  step time and each rank's bytes of parameters, gradients and optimizer state.

Times are medians over the timed steps, after two warm-up steps per way. The targets are
printed at the end as PASS or FAIL lines; a FAIL does not change the exit status (a loaded
machine can fail a timing), but a way that fails to run (a rank raises, dies or does not
answer in time) makes the script exit 1 after printing what it measured. Every wait for
another process is bounded, and every process is ended and reaped, also on failure. Only
ratios within one run are meaningful.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mesh_bench import measure_mesh, report
from _step_models import (
    RANK_WAYS,
    UNCHECKED_WAYS,
    Case,
    Check,
    Ways,
    add_selection,
    bench_parser,
    calibrated_sleep,
    describe_sleep,
    finish,
    ideal_checks,
    measure,
    mlp_case,
    ms,
    parallel_speedup,
    parse_bench,
    print_fixed_time,
    print_table,
    print_unrun,
    sleep_case,
    tiny_case,
    transformer_case,
)

SCHEDULES = ("gpipe", "1f1b")
CASES = ("fixed-time", "mlp", "transformer", "tiny", "mesh")
WAYS = ("plain", "plain mb", "step gpipe", "step 1f1b", *RANK_WAYS)
#: Seconds any wait for a rank may last (a step, the start of the processes).
TIMEOUT = 120.0


def paired_check_costs(
    runners: dict[str, Any], pairs: int, *, tasks: int
) -> dict[str, float | None]:
    """What the ranks' agreement check of every run adds per task (us), for each schedule:
    the median of the differences of ``pairs`` pairs of steps, checked and unchecked one
    right after the other (each first in turn), so that the machine's drifts cancel."""
    costs: dict[str, float | None] = {}
    for schedule in SCHEDULES:
        checked = runners.get(f"dist {schedule}")
        unchecked = runners.get(f"dist {schedule} unchecked")
        if not callable(checked) or not callable(unchecked):
            costs[schedule] = None
            continue
        differences = []
        for k in range(pairs):
            if k % 2:
                b, a = unchecked(), checked()
            else:
                a, b = checked(), unchecked()
            differences.append(a - b)
        costs[schedule] = statistics.median(differences) / tasks * 1e6
    return costs


def check_work_per_task(tasks: int, repeats: int = 2000) -> float:
    """The work the agreement check adds to a step on one rank, timed alone (us per task):
    its run fields pickled into the plan and into the last message and read back, and
    compared once (what a build with the check turned off does not do)."""
    import pickle

    from gpipe_core.transport._agreement import run_fields

    fields = run_fields("step", chunks=4, schedule="1f1b", reduction="mean", training=True)
    start = time.perf_counter()
    for _ in range(repeats):
        for _message in range(2):  # the plan, and the last message of the run
            theirs = pickle.loads(pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL))
        _ = theirs != fields
    return (time.perf_counter() - start) / repeats / tasks * 1e6


def _difference(costs: dict[str, float | None], schedule: str) -> str:
    cost = costs.get(schedule)
    return "-" if cost is None else f"{cost:+.1f} us per task"


def print_bounds(cases: Sequence[Case], results: dict[str, dict[str, Any]]) -> None:
    """Each compute-bound case's bound, and each pipelined way over it.

    On ``n`` processes of one core each, ``n`` stages cannot do better than the work of the
    micro-batches (``plain mb``: the same model on the same micro-batches, one after the
    other, in one process) shared evenly, with only the pipeline's fill and drain idle:
    ``plain mb * (m + n - 1) / (n m)``. A way at ``r`` times the bound can be beaten by at
    most a factor ``r``: a target of ``0.90`` times pipelining's time is out of reach where
    pipelining is within ``1 / 0.90 = 1.11`` times the bound.
    """
    rows = []
    for case in cases:
        r = results.get(case.name, {})
        serial = r.get("plain mb")
        if not isinstance(serial, float):
            continue
        n, m = len(case.balance), case.chunks
        bound = serial * (m + n - 1) / (n * m)
        row = [case.name, ms(bound)]
        for way in RANK_WAYS:
            value = r.get(way)
            row.append(f"{value / bound:.3f}" if isinstance(value, float) else "-")
        rows.append(row)
    if rows:
        print(
            "Compute-bound cases: each way over the bound plain mb * (m + n - 1) / (n m), the "
            "micro-batches' work shared evenly by the n processes (lower is better, 1.00 at best)"
        )
        print_table(["case", "bound ms", *RANK_WAYS], rows)
        print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    add_selection(parser, "cases", CASES)
    args, rounds, sizes, chosen = parse_bench(parser, argv, ("cases", CASES))
    torch.set_num_threads(args.threads)
    mlp, transformer, tiny = mlp_case(sizes), transformer_case(sizes), tiny_case()

    print(
        f"Stages across processes: CPU, torch {torch.__version__}, intra-op threads "
        f"{torch.get_num_threads()} per process (torch.set_num_threads({args.threads})), "
        f"{os.cpu_count()} cores, {rounds} rounds (medians), ways interleaved"
    )
    print(f"  {sizes.describe(('fixed-time', 'MLP', 'transformer'))}; tiny: Linear(4, 4) per stage")
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"  load average {load}; two threads run {parallel_speedup():.2f}x as fast as one on "
        "independent matmuls (2.00 on two idle cores; less when other processes use them)"
    )
    sleep = sizes.sleep
    if "fixed-time" in chosen:
        sleep, alone = calibrated_sleep(sizes.sleep)
        print(f"  {describe_sleep(sizes.sleep, sleep, alone)}")
    print()

    # Each case with its ways and rounds: fixed-time steps are long (no plain: its ideal is
    # known; plain mb measures a stage's time here), tiny ones short. plain mb also gives
    # the compute-bound cases their bound (see print_bounds).
    others = [way for way in WAYS if way != "plain mb"]
    plan: list[tuple[Case, Sequence[str], int]] = []
    fixed = [sleep_case(n, 8, sizes.sleep, sleep) for n in (2, 4)] if "fixed-time" in chosen else []
    for case in fixed:
        plan.append((case, WAYS[1:], max(2, rounds // 2)))
    computed = [case for key, case in (("mlp", mlp), ("transformer", transformer)) if key in chosen]
    for case in computed:
        plan.append((case, WAYS, rounds))
    if "tiny" in chosen:
        plan.append((tiny, [*others, *UNCHECKED_WAYS], rounds * 10))

    ways = Ways(args.threads, TIMEOUT)
    check_costs: dict[str, float | None] = {}
    results: dict[str, dict[str, Any]] = {}
    ideals: dict[str, float] = {}
    try:
        for case, names, case_rounds in plan:
            built = ways.build(case, names)
            results[case.name] = measure(built, case_rounds)
            if case is tiny:
                tasks = len(tiny.balance) * tiny.chunks
                check_costs = paired_check_costs(built, max(100, 30 * rounds), tasks=tasks)
            ways.close()
            if case.ideal is not None:
                ideals[case.name] = case.ideal
            print(f"  measured {case.name}", file=sys.stderr, flush=True)
    finally:
        ways.close()

    # Step times --------------------------------------------------------------------------------
    print("Step time, ms (medians)")
    rows = []
    for case_name, r in results.items():
        rows.append([case_name, *(ms(r[w]) if isinstance(r.get(w), float) else "-" for w in WAYS)])
    print_table(["case", *WAYS], rows)
    print()

    rows = []
    for case_name, r in results.items():
        ideal = ideals.get(case_name)
        ref = ideal if ideal is not None else r["plain"]
        if case_name == tiny.name or not isinstance(ref, float):
            continue  # the tiny model's plain is almost nothing: see its overhead per task
        row = [case_name, "ideal" if ideal is not None else "plain", ms(ref)]
        for way in WAYS:
            value = r.get(way)
            serial = way == "plain mb"  # not a pipeline: 2 n m t
            row.append(f"{value / ref:.2f}" if isinstance(value, float) and not serial else "-")
        rows.append(row)
    if rows:
        print("Step time relative to the reference (lower is better)")
        print_table(["case", "reference", "ref ms", *WAYS], rows)
        print()
    print_fixed_time(fixed, results, WAYS)
    print_bounds(computed, results)

    print("gpipe across processes relative to pipelining, same schedule (lower is better)")
    rows = []
    versus: dict[tuple[str, str], float | None] = {}
    for case_name, r in results.items():
        row = [case_name]
        for schedule in SCHEDULES:
            ours, theirs = r.get(f"dist {schedule}"), r.get(f"pipe {schedule}")
            ratio = ours / theirs if isinstance(ours, float) and isinstance(theirs, float) else None
            versus[case_name, schedule] = ratio
            row.append("-" if ratio is None else f"{ratio:.2f}")
        rows.append(row)
    print_table(["case", "dist/pipe gpipe", "dist/pipe 1f1b"], rows)
    print()

    overhead: dict[str, float | None] = {}
    if tiny.name in results:
        tasks = len(tiny.balance) * tiny.chunks
        r = results[tiny.name]
        plain = r["plain"]
        rows = []
        for way in [*others[1:], *UNCHECKED_WAYS]:
            value = r.get(way)
            ok = isinstance(value, float) and isinstance(plain, float)
            per_task = (value - plain) / tasks * 1e6 if ok else None
            overhead[way] = per_task
            rows.append([way, "-" if per_task is None else f"{per_task:.0f}"])
        print(
            f"Overhead per task, {tiny.name} (Linear(4, 4) per partition): (time - plain) / "
            "(n * m), "
            + (f"plain {plain * 1e3:.2f} ms per step" if isinstance(plain, float) else "no plain")
        )
        print_table(["way", "us per task"], rows)
        print(
            "  the ranks' agreement check of every run, median of paired differences "
            "(dist - dist unchecked, one right after the other): "
            + ", ".join(
                f"{schedule} {_difference(check_costs, schedule)}" for schedule in SCHEDULES
            )
            + f"; the check's own work timed alone: {check_work_per_task(tasks):.2f} us per task"
        )
        print()

    problems = {
        f"{case_name}: {way}": value
        for case_name, r in results.items()
        for way, value in r.items()
        if isinstance(value, str)
    }
    mesh_checks: list[Check] = []
    if "mesh" in chosen:
        found = measure_mesh(args.quick, max(3, rounds // 2))
        mesh_checks = report(found)
        if isinstance(found, str):
            problems["mesh"] = found
    print_unrun(problems)

    # Targets -----------------------------------------------------------------------------------
    checks: list[Check] = ideal_checks(ideals, results, "dist", 1.05)
    for case in (mlp, transformer):
        if case.name not in results:
            continue
        for schedule in SCHEDULES:
            checks.append(
                (
                    f"{case.name}: dist {schedule} / pipe {schedule} <= 0.90",
                    versus[case.name, schedule],
                    0.90,
                )
            )
    for schedule in SCHEDULES if tiny.name in results else ():
        checks.append(
            (
                f"{tiny.name}: dist {schedule} overhead per task <= 150 us",
                overhead[f"dist {schedule}"],
                150.0,
            )
        )
    for schedule in SCHEDULES if tiny.name in results else ():
        checks.append(
            (
                f"{tiny.name}: dist {schedule} agreement check <= 5 us per task",
                check_costs.get(schedule),
                5.0,
            )
        )
    checks += mesh_checks
    return finish(checks, problems, ways)


if __name__ == "__main__":
    sys.exit(main())
