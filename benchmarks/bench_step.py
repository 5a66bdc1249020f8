"""Schedules and steps: gpipe's two paths side by side with plain PyTorch and its peers.

Run it as a script (``python benchmarks/bench_step.py``, ``--quick`` for a short run), or
with ``nox -s bench``.

First, at **default threading** (nothing sets the intra-op threads: torch's default, one per
core, and gpipe's division of them among its workers), a GPT-like model, the MLP and the
transformer: ``plain``, ``fwd+bwd`` and ``step`` with each schedule, interleaved, relative to
``plain``, beside the bound of a pipeline of ``n`` single-threaded workers: the plain model's
single-thread time x ``(m + n - 1) / (n m)`` over plain's time (the single-thread time is
measured in the same rounds, interleaved with the others, in a thread of its own that sets
its intra-op threads to one: the count is kept per thread, so the thread that runs the other
ways keeps torch's default). Targets: ``step`` with each schedule and ``fwd+bwd`` at most 1.05 x the
bound, or 1.05 x plain where the bound is below plain. Beside it, the same bound from the
plain model's single-thread time on the micro-batches one after the other (``mb bound``: the
work the workers actually share, whose smaller matrix products cost more per sample on a
CPU), and each way's ratio to it; and for ``fwd+bwd``, the bound where autograd runs every
backward pass in the calling thread, as it does on the CPU (``autograd bound``: the
micro-batches' single-thread forward passes shared by the workers, then their backward
passes one after the other at default threading).

The same table is then measured **as a user runs a training script**: each way (``plain``,
``fwd+bwd``, ``step`` per schedule, and the bounds' single-thread and micro-batched
phases) in a fresh process of its own that builds nothing else, three rounds interleaved
(each way goes first in turn); the targets are checked on both tables. In one process the
other ways' thread pools and the one-thread runner's thread share the cores with the way
timed; in its own process a way has them alone.

Then, with one intra-op thread (``torch.set_num_threads(1)``, or ``--threads``),
one training step (forward, loss and backward of the whole batch) is timed these ways,
interleaved round by round (each way goes first in turn) so that the machine's load affects
them alike:

- ``plain``: the ``nn.Sequential`` itself on the whole batch;
- ``plain mb``: the same on the micro-batches, one after the other (what micro-batching
  alone costs, before any overlap);
- ``fwd+bwd``: ``GPipe.forward()`` then ``loss.backward()`` (autograd drives the backward);
- ``step gpipe`` and ``step 1f1b``: ``GPipe.step`` with each schedule (each partition's
  worker runs its own forwards and backwards);
- ``torchgpipe``: torchgpipe 0.0.7, when it is installed and works with this torch;
- ``pipe gpipe`` and ``pipe 1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
  ``Schedule1F1B`` over gloo, one process per stage, timed from a barrier to the last
  rank's end.

A way that cannot run says why in a row of its own. Cases:

- fixed-time stages (P2 M8, P4 M8): each partition is an autograd function whose forward and
  backward each take ``t`` (a sleep, releasing the GIL), so the ideal step takes
  ``2 * (m + n - 1) * t``; ratios are to that ideal. A stage that sleeps ``t`` takes longer
  than ``t`` on a real machine (the sleep overshoots, and the code after it runs on a core
  that has just woken up), so the sleep is calibrated first, serially in this process, to
  make a stage take ``t`` (the header says by how much it is shortened). ``plain mb`` runs
  the stages one after the other in the same run, and its time over ``2 * n * m * t``
  checks the calibration; a second table shows each way against the ideal scaled by it;
- an MLP (P2 M4), a small ResNet-style CNN and a transformer-block stack (P2 M4): ratios to
  ``plain``; no checkpointing anywhere, so every way computes the same thing;
- a tiny model (one ``Linear(4, 4)`` per partition, P2 M32): the overhead per task,
  ``(time - plain) / (n * m)`` in microseconds, with ``checkpoint='never'`` and
  ``'except_last'``. gpipe's ways and torchgpipe are timed with no other process running;
  the ``pipe`` ways after them, with a ``plain`` of their own, since their processes keep the
  cores awake (which hides what waking a sleeping worker thread costs); beside them, the floor
  of any step: the model on each micro-batch in turn in one thread (``plain mb``), and the
  same cut at the partitions, one backward call per partition and micro-batch
  (``plain mb cut``);
- beside the tiny model's ways, ``step 1f1b`` with its loss written as a ``BatchMean`` (the
  mini-batch counted before the run) and with its input as a dict, each against the plain
  mean's and the tensor's ``step 1f1b``;
- one partition, one micro-batch, no checkpointing: ``fwd+bwd`` relative to ``plain``;
- activation memory: the bytes of the tensors saved for backward (counted by saved-tensor
  hooks, each storage once, parameters excluded), after the forward and at the peak, for
  each path and schedule, against the theoretical figures (GPipe keeps all ``m`` micro-batches
  on every partition; 1F1B at most ``n - j`` on partition ``j``).

Times are medians. The targets of the schedules work are checked at the end and printed as
PASS or FAIL lines; the script exits 0 either way (a loaded machine can fail a timing). Only
ratios within one run are meaningful.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpipe_core
from _step_models import (
    Case,
    Check,
    Ranks,
    Runner,
    SavedBytes,
    Sizes,
    bench_parser,
    calibrated_sleep,
    cnn_case,
    describe_sleep,
    gpt_case,
    ideal_checks,
    measure,
    mlp_case,
    ms,
    parallel_speedup,
    parse_bench,
    per_microbatch_bytes,
    pipelining_check,
    plain_cut_runner,
    plain_microbatched_phases_runners,
    plain_microbatched_runner,
    plain_runner,
    print_fixed_time,
    print_table,
    print_targets,
    print_unrun,
    sleep_case,
    thread_round_trip,
    timed,
    tiny_case,
    transformer_case,
)
from gpipe_core import GPipe

HAS_STEP = hasattr(GPipe, "step")
BatchMean = getattr(gpipe_core, "BatchMean", None)
SCHEDULES = ("gpipe", "1f1b")
# The ways that checkpoint (the tiny model is also timed with checkpoint='except_last').
CHECKPOINTING = ("fwd+bwd", "torchgpipe")
WAYS = (
    "plain",
    "plain mb",
    "fwd+bwd",
    "step gpipe",
    "step 1f1b",
    "torchgpipe",
    "pipe gpipe",
    "pipe 1f1b",
)


class Unavailable(Exception):
    """A way that cannot run here; the message says why."""


# --------------------------------------------------------------------------------------------
# The ways
# --------------------------------------------------------------------------------------------


def gpipe_runners(case: Case, suffix: str = "") -> dict[str, Runner | str]:
    model = GPipe(case.model(), case.balance, chunks=case.chunks, checkpoint=case.checkpoint)
    x, y = case.data()
    loss_fn = case.loss_fn()
    runners: dict[str, Runner | str] = {
        "fwd+bwd" + suffix: timed(model, lambda: loss_fn(model(x), y).backward())
    }
    for schedule in SCHEDULES:
        if HAS_STEP:
            runners[f"step {schedule}" + suffix] = timed(
                model,
                lambda schedule=schedule: model.step(x, y, loss_fn, schedule=schedule),  # type: ignore[misc]
            )
        else:
            runners[f"step {schedule}" + suffix] = "not available: this gpipe has no GPipe.step"
    return runners


def loss_form_runners(case: Case) -> dict[str, Runner | str]:
    """``step 1f1b`` with the case's loss (an MSE mean) written as a :class:`BatchMean`
    (its sum over elements, divided by the mini-batch's count): the cost of counting the
    mini-batch before the run, beside the plain mean's ``step 1f1b`` in the same group."""
    name = "step 1f1b BatchMean (never)"
    if BatchMean is None:
        return {name: "not available: this gpipe has no BatchMean"}
    model = GPipe(case.model(), case.balance, chunks=case.chunks, checkpoint="never")
    x, y = case.data()
    mean = BatchMean(
        lambda output, target: torch.nn.functional.mse_loss(output, target, reduction="sum"),
        lambda target: target.numel(),
    )
    return {name: timed(model, lambda: model.step(x, y, mean, schedule="1f1b"))}


class _FromDict(torch.nn.Module):
    """A layer that takes its input from a dict's ``"x"``: the first layer of the case, fed a
    dict batch."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.layer(batch["x"])


def unwatched_runners(case: Case) -> dict[str, Runner | str]:
    """``step`` with each schedule without the one-turn watcher (a run in one turn never
    handed over to the workers: ``Turns.hand_over_after = None``, what tests of layers that
    never wait for another's set), to time what the watcher costs (A/B in the same rounds)."""
    from gpipe_core.run._turns import Turns

    made = gpipe_runners(case)
    runners: dict[str, Runner | str] = {}
    for schedule in SCHEDULES:
        watched = made[f"step {schedule}"]
        if isinstance(watched, str):
            runners[f"step {schedule} unwatched (never)"] = watched
            continue

        def unwatched(watched: Runner = watched) -> float:
            patience = Turns.hand_over_after
            Turns.hand_over_after = None
            try:
                return watched()
            finally:
                Turns.hand_over_after = patience

        runners[f"step {schedule} unwatched (never)"] = unwatched
    return runners


def dict_input_runners(case: Case) -> dict[str, Runner | str]:
    """``step 1f1b`` with the same model fed ``{"x": input}``: the cost of a mapping batch
    (split, carried and gathered with its keys), beside the tensor's ``step 1f1b``."""
    name = "step 1f1b dict input (never)"
    if not hasattr(gpipe_core, "BatchMean"):  # mappings came in the same release
        return {name: "not available: this gpipe takes no dict batch"}
    model = case.model()
    model[0] = _FromDict(model[0])
    pipe = GPipe(model, case.balance, chunks=case.chunks, checkpoint="never")
    x, y = case.data()
    loss_fn, batch = case.loss_fn(), {"x": x}
    return {name: timed(pipe, lambda: pipe.step(batch, y, loss_fn, schedule="1f1b"))}


def torchgpipe_runner(case: Case) -> Runner:
    try:
        import torchgpipe
    except ImportError as error:
        raise Unavailable(f"not installed: {error}") from None
    model = torchgpipe.GPipe(
        case.model(),
        case.balance,
        devices=["cpu"] * len(case.balance),
        chunks=case.chunks,
        checkpoint=case.checkpoint,
    )
    x, y = case.data()
    loss_fn = case.loss_fn()
    return timed(model, lambda: loss_fn(model(x), y).backward())


class Ways:
    """Builds the runners of one case; a way that cannot run becomes its reason."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.groups: list[Ranks] = []

    def build(self, case: Case, ways: Sequence[str], suffix: str = "") -> dict[str, Runner | str]:
        runners: dict[str, Runner | str] = {}
        if "plain" in ways:
            runners["plain"] = plain_runner(case)
        if "plain mb" in ways:
            runners["plain mb"] = plain_microbatched_runner(case)
        if "fwd+bwd" in ways:
            runners.update(gpipe_runners(case, suffix))
        if "torchgpipe" in ways:
            try:
                runners["torchgpipe" + suffix] = torchgpipe_runner(case)
            except Unavailable as error:
                runners["torchgpipe" + suffix] = str(error)
            except Exception as error:
                runners["torchgpipe" + suffix] = f"does not work here: {error!r}"
        if "pipe gpipe" in ways:
            reason = pipelining_check()
            group: Ranks | None = None
            if reason is None:
                try:
                    group = Ranks(case, ("pipe gpipe", "pipe 1f1b"), self.threads)
                    self.groups.append(group)
                except Exception as error:
                    reason = f"does not work here: {error}"
            for schedule in SCHEDULES:
                way = f"pipe {schedule}"
                if group is None:
                    runners[way + suffix] = str(reason)
                else:
                    runners[way + suffix] = lambda group=group, way=way: group.step(way)  # type: ignore[misc]
        return runners

    def close(self) -> None:
        for group in self.groups:
            group.close()
        self.groups.clear()


# --------------------------------------------------------------------------------------------
# Default threading
# --------------------------------------------------------------------------------------------

DEFAULT_WAYS = ("plain", "fwd+bwd", "step gpipe", "step 1f1b")


def default_cases(sizes: Sizes) -> list[Case]:
    return [gpt_case(sizes), mlp_case(sizes), transformer_case(sizes)]


class OneThread:
    """Runs runners in a thread of its own with one intra-op thread (torch's count is kept per
    thread where torch has OpenMP), so that the single-thread times are measured in the same
    rounds as the default-threading ways, and this thread keeps torch's default."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="one-thread")
        self.caller = torch.get_num_threads()

    def __call__(self, runner: Runner) -> Runner:
        def in_thread() -> float:
            torch.set_num_threads(1)
            try:
                return runner()
            finally:  # also the count that threads started later begin with
                torch.set_num_threads(self.caller)

        return lambda: self.pool.submit(in_thread).result()

    def close(self) -> None:
        self.pool.shutdown()


def default_threading(sizes: Sizes, quick: bool, rounds: int) -> list[Check]:
    """The default-threading table and its targets (see the module docstring)."""
    print(
        f"Default threading: torch.get_num_threads() = {torch.get_num_threads()} (not set), "
        f"{os.cpu_count()} cores, {rounds} rounds (medians), ways interleaved; no checkpointing"
    )
    print(f"  {sizes.describe(('GPT', 'MLP', 'transformer'))}")
    if not torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]
        print("  not measured: this torch has no OpenMP (one intra-op count for all threads)\n")
        return []
    rows, checks = [], []
    one_thread = OneThread()
    for case in default_cases(sizes):
        runners: dict[str, Runner | str] = {"plain": plain_runner(case)}
        runners.update(gpipe_runners(case))
        runners["plain mb bwd"] = plain_microbatched_phases_runners(case)["plain mb bwd"]
        runners["1-thread"] = one_thread(plain_runner(case))
        runners["1-thread mb"] = one_thread(plain_microbatched_runner(case))
        forward = plain_microbatched_phases_runners(case)["plain mb fwd"]
        runners["1-thread mb fwd"] = one_thread(forward)
        times = measure(runners, rounds)
        single, single_mb, single_mb_fwd = (
            times[w] for w in ("1-thread", "1-thread mb", "1-thread mb fwd")
        )
        n, m = len(case.balance), case.chunks
        plain = times["plain"]
        bound = single * (m + n - 1) / (n * m) / plain
        # The same with the micro-batches' single-thread time: what n single-threaded
        # workers computing the micro-batches can reach (smaller products cost more).
        bound_mb = single_mb * (m + n - 1) / (n * m) / plain
        # fwd+bwd on the CPU: autograd runs every backward pass in the calling thread, after
        # the workers' forward passes; at best, those at the workers' bound, then the
        # micro-batches' backward passes one after the other at default threading.
        bound_autograd = (single_mb_fwd * (m + n - 1) / (n * m) + times["plain mb bwd"]) / plain
        ratios = {
            w: times[w] / plain if isinstance(times[w], float) else None for w in DEFAULT_WAYS
        }
        rows.append(
            [
                case.name,
                ms(plain),
                ms(single),
                f"{bound:.2f}",
                ms(single_mb),
                f"{bound_mb:.2f}",
                f"{bound_autograd:.2f}",
                *(f"{r:.2f}" if r is not None else "-" for r in list(ratios.values())[1:]),
            ]
        )
        # Within 5% of what n single-threaded workers can do, or of plain where they can do
        # better than plain.
        limit = 1.05 * max(bound, 1.0)
        for way in ("step gpipe", "step 1f1b", "fwd+bwd"):
            autograd = (
                f"; with autograd's backward in the calling thread the bound is "
                f"{bound_autograd:.2f}, {way} / that {(ratios[way] or 0) / bound_autograd:.2f}"
                if way == "fwd+bwd"
                else ""
            )
            checks.append(
                (
                    f"default threads, {case.name}: {way} / plain <= 1.05 x max(bound "
                    f"{bound:.2f}, 1) = {limit:.2f} (on the micro-batches the bound is "
                    f"{bound_mb:.2f}, {way} / that {ratios[way] / bound_mb:.2f}{autograd})"
                    if ratios[way] is not None
                    else f"default threads, {case.name}: {way} / plain <= {limit:.2f}",
                    ratios[way],
                    limit,
                )
            )
        print(f"  measured {case.name}", file=sys.stderr, flush=True)
    print("Step time relative to plain at default threading (lower is better)")
    print_table(
        [
            "case", "plain ms", "1-thread ms", "bound", "1-thread mb ms", "mb bound",
            "autograd bound", "fwd+bwd", "step gpipe", "step 1f1b",
        ],
        rows,
    )  # fmt: skip
    print(
        "  bound: plain's 1-thread time x (m + n - 1) / (n m) over plain's time, what n "
        "single-threaded workers can reach;\n  mb bound: the same from plain's 1-thread time "
        "on the micro-batches one after the other (the work the workers share);\n  autograd "
        "bound: fwd+bwd's, where autograd runs the backward passes in the calling thread: "
        "plain's 1-thread forward passes on the micro-batches x (m + n - 1) / (n m), then "
        "its backward passes on them at default threading, over plain's time"
    )
    print()
    one_thread.close()
    return checks


# --------------------------------------------------------------------------------------------
# Default threading, each way in a process of its own (as a user runs a training script)
# --------------------------------------------------------------------------------------------

#: The ways of the per-process table: the default-threading ways, and the plain model with
#: one intra-op thread (the bound's single-thread time), each alone in a fresh process.
PROCESS_WAYS = (*DEFAULT_WAYS, "1-thread", "1-thread mb fwd", "plain mb bwd")
#: How many times a process times its way (median); the rounds start new processes.
PROCESS_REPEATS = 5


def one_way(case_name: str, way: str, repeats: int, quick: bool) -> float:
    """The median seconds of ``way`` on the default-threading case ``case_name``, in this
    process alone (``--one-way``): nothing else built, no other thread pool started."""
    if way.startswith("1-thread"):
        torch.set_num_threads(1)
    case = {c.name: c for c in default_cases(Sizes.of(quick))}[case_name]
    runners: dict[str, Runner | str]
    if way in ("plain", "1-thread"):
        runners = {way: plain_runner(case)}
    elif way in ("1-thread mb fwd", "plain mb bwd"):
        phases = plain_microbatched_phases_runners(case)
        runners = {way: phases["plain mb fwd" if way == "1-thread mb fwd" else way]}
    else:
        runners = gpipe_runners(case)
    time = measure({way: runners[way]}, repeats)[way]
    if not isinstance(time, float):
        raise RuntimeError(f"{way} on {case_name}: {time}")
    return time


def per_process(sizes: Sizes, quick: bool, rounds: int) -> list[Check]:
    """The default-threading table with each way in a fresh process of its own, rounds
    interleaved (each way goes first in turn), and its targets."""
    cases = [case.name for case in default_cases(sizes)]
    print(
        f"Default threading, each way in a process of its own (torch's default threads, "
        f"{os.cpu_count()} cores): {rounds} rounds of a fresh process per way, each the "
        f"median of {PROCESS_REPEATS} steps; the round's medians' median"
    )
    times: dict[str, dict[str, list[float]]] = {c: {w: [] for w in PROCESS_WAYS} for c in cases}
    failures: dict[tuple[str, str], str] = {}
    script = str(Path(__file__).resolve())
    for k in range(rounds):
        for case_name in cases:
            order = list(
                PROCESS_WAYS[k % len(PROCESS_WAYS) :] + PROCESS_WAYS[: k % len(PROCESS_WAYS)]
            )
            for way in order:
                if (case_name, way) in failures:
                    continue
                command = [sys.executable, script, "--one-way", case_name, way]
                command += ["--repeats", str(PROCESS_REPEATS), *(["--quick"] if quick else [])]
                env = {key: v for key, v in os.environ.items() if key != "OMP_NUM_THREADS"}
                done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
                if done.returncode:
                    lines = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    failures[case_name, way] = f"failed: {lines}"
                    continue
                times[case_name][way].append(float(done.stdout.split()[-1]))
        print(f"  per-process round {k + 1} of {rounds}", file=sys.stderr, flush=True)
    rows, checks = [], []
    n_m = {case.name: (len(case.balance), case.chunks) for case in default_cases(sizes)}
    for case_name in cases:
        median = {
            w: statistics.median(t)
            for w, t in times[case_name].items()
            if t and (case_name, w) not in failures
        }
        if "plain" not in median or "1-thread" not in median:
            rows.append([case_name, *(["-"] * 7)])
            continue
        n, m = n_m[case_name]
        plain = median["plain"]
        bound = median["1-thread"] * (m + n - 1) / (n * m) / plain
        limit = 1.05 * max(bound, 1.0)
        ratios = {w: median[w] / plain if w in median else None for w in DEFAULT_WAYS[1:]}
        autograd = None
        if "1-thread mb fwd" in median and "plain mb bwd" in median:
            forward = median["1-thread mb fwd"] * (m + n - 1) / (n * m)
            autograd = (forward + median["plain mb bwd"]) / plain
        rows.append(
            [
                case_name, ms(plain), ms(median["1-thread"]), f"{bound:.2f}",
                f"{autograd:.2f}" if autograd is not None else "-",
                *(f"{r:.2f}" if r is not None else "-" for r in ratios.values()),
            ]
        )  # fmt: skip
        if autograd is not None:
            checks.append(
                (
                    f"default threads, one process per way, {case_name}: fwd+bwd / plain <= "
                    f"1.05 x its autograd bound {autograd:.2f} = {1.05 * autograd:.2f}",
                    ratios["fwd+bwd"],
                    1.05 * autograd,
                )
            )
        for way in ("step gpipe", "step 1f1b"):
            checks.append(
                (
                    f"default threads, one process per way, {case_name}: {way} / plain <= 1.05 "
                    f"x max(bound {bound:.2f}, 1) = {limit:.2f}",
                    ratios[way],
                    limit,
                )
            )
    print("Step time relative to plain, each way in a process of its own (lower is better)")
    print_table(
        [
            "case",
            "plain ms",
            "1-thread ms",
            "bound",
            "autograd bound",
            "fwd+bwd",
            "step gpipe",
            "step 1f1b",
        ],
        rows,
    )
    for (case_name, way), reason in failures.items():
        print(f"  {case_name}, {way}: {reason}")
    print(
        "  the same bound and ways as the in-process table above, each timed in a fresh "
        "process with nothing else built in it\n"
    )
    return checks


# --------------------------------------------------------------------------------------------
# Activation memory
# --------------------------------------------------------------------------------------------


def memory(case: Case) -> dict[str, Any]:
    n, m = len(case.balance), case.chunks
    per_mb = per_microbatch_bytes(case)
    x, y = case.data()
    loss_fn = case.loss_fn()
    result: dict[str, Any] = {
        "micro-batch": sum(per_mb),
        "theory gpipe": m * sum(per_mb),
        "theory 1f1b": sum(min(n - j, m) * a for j, a in enumerate(per_mb)),
    }

    plain = case.model()
    counter = SavedBytes([*plain.parameters(), x, y])
    with counter.hooks():
        loss = loss_fn(plain(x), y)
        after = counter.live
        loss.backward()
    result["plain"] = (after, counter.peak, counter.live)
    del loss

    model = GPipe(case.model(), case.balance, chunks=m, checkpoint=case.checkpoint)
    counter = SavedBytes([*model.parameters(), x, y])
    with counter.hooks():
        loss = loss_fn(model(x), y)
        after = counter.live
        loss.backward()
    result["fwd+bwd"] = (after, counter.peak, counter.live)
    del loss
    for schedule in SCHEDULES:
        if not HAS_STEP:
            result[f"step {schedule}"] = "not available: this gpipe has no GPipe.step"
            continue
        counter = SavedBytes([*model.parameters(), x, y])
        with counter.hooks():
            model.step(x, y, loss_fn, schedule=schedule)  # type: ignore[attr-defined]
        result[f"step {schedule}"] = (None, counter.peak, counter.live)
    return result


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def reasons_of(results: dict[str, Any], seen: dict[str, str]) -> None:
    for name, value in results.items():
        if isinstance(value, str):
            seen.setdefault(name.split(" (")[0], value)


def main(argv: Sequence[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--default-threading-only",
        action="store_true",
        help="only the default-threading table and its targets",
    )
    parser.add_argument("--one-way", nargs=2, metavar=("CASE", "WAY"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=PROCESS_REPEATS, help=argparse.SUPPRESS)
    args, rounds, sizes, _ = parse_bench(parser, argv)
    quick = args.quick
    if args.one_way:  # one way of the per-process table, in this process alone
        print(one_way(*args.one_way, args.repeats, quick))
        return
    # Before anything sets the intra-op threads.
    default_checks = default_threading(sizes, quick, rounds)
    default_checks += per_process(sizes, quick, 3)
    if args.default_threading_only:
        print_targets(default_checks)
        return
    torch.set_num_threads(args.threads)

    mlp, cnn, transformer, tiny = (
        mlp_case(sizes),
        cnn_case(sizes),
        transformer_case(sizes),
        tiny_case(),
    )

    print(
        f"Schedules and steps: CPU, torch {torch.__version__}, intra-op threads "
        f"{torch.get_num_threads()} (torch.set_num_threads({args.threads})), "
        f"{os.cpu_count()} cores, {rounds} rounds (medians), ways interleaved"
    )
    print(f"  {sizes.describe()}")
    print(
        f"  two threads run {parallel_speedup():.2f}x as fast as one on independent matmuls "
        "(2.00 on two idle cores; less when other processes use them)"
    )
    sleep, alone = calibrated_sleep(sizes.sleep)
    print(f"  {describe_sleep(sizes.sleep, sleep, alone)}")
    if not HAS_STEP:
        print("  note: this gpipe has no GPipe.step; its columns say so")
    print()

    ways = Ways(args.threads)
    reasons: dict[str, str] = {}
    results: dict[str, dict[str, Any]] = {}
    ideals: dict[str, float] = {}
    try:
        # Time cases ------------------------------------------------------------------------
        fixed = [sleep_case(n, 8, sizes.sleep, sleep) for n in (2, 4)]
        for case in [
            *fixed,
            mlp,
            cnn,
            transformer,
        ]:
            # Fixed-time cases: no plain (the ideal is known), but plain mb, whose serial
            # run measures what a stage takes here (see print_fixed_time).
            names = WAYS[1:] if case.ideal is not None else WAYS
            case_rounds = max(2, rounds // 2) if case.ideal is not None else rounds
            results[case.name] = measure(ways.build(case, names), case_rounds)
            if case.ideal is not None:
                ideals[case.name] = case.ideal
            ways.close()
            reasons_of(results[case.name], reasons)
            print(f"  measured {case.name}", file=sys.stderr, flush=True)

        header = ["case", "reference", "ref ms", *WAYS]
        rows = []
        for case_name, r in results.items():
            ideal = ideals.get(case_name)
            ref = ideal if ideal is not None else r["plain"]
            row = [case_name, "ideal" if ideal is not None else "plain", ms(ref)]
            for way in WAYS:
                value = r.get(way)
                serial = ideal is not None and way == "plain mb"  # not a pipeline: 2 n m t
                row.append(f"{value / ref:.2f}" if isinstance(value, float) and not serial else "-")
            rows.append(row)
        print("Step time relative to the reference (lower is better)")
        print_table(header, rows)
        print()
        print_fixed_time(fixed, results, WAYS)

        # Per-task overhead -------------------------------------------------------------------
        # Two groups, each with its own plain: the ways of this process first, then the
        # pipelining ways, whose processes would keep the cores awake for the first group.
        tasks = len(tiny.balance) * tiny.chunks
        overhead: dict[str, float | str] = {}  # microseconds per task, or why not measured
        # Step time of a way / of step 1f1b with a tensor input and a plain mean.
        against_base: dict[str, float] = {}
        plains: list[float] = []
        for group in (WAYS[2:6], WAYS[6:]):
            runners: dict[str, Runner | str] = {"plain": plain_runner(tiny)}
            if group == WAYS[2:6]:
                # The floor of any step, beside gpipe's ways: the micro-batches one after
                # the other in this thread, with and without the partitions' cuts.
                runners["plain mb"] = plain_microbatched_runner(replace(tiny, checkpoint="never"))
                runners["plain mb cut"] = plain_cut_runner(tiny)
                runners.update(loss_form_runners(tiny))
                runners.update(dict_input_runners(tiny))
                runners.update(unwatched_runners(replace(tiny, checkpoint="never")))
            for mode in ("never", "except_last"):
                case = replace(tiny, checkpoint=mode)
                built = group if mode == "never" else [w for w in group if w in CHECKPOINTING]
                runners.update(ways.build(case, built, f" ({mode})"))
            times = measure(runners, rounds * 10)
            ways.close()
            plain = times.pop("plain")
            plains.append(plain)
            for name, value in times.items():
                per_task = (value - plain) / tasks * 1e6 if isinstance(value, float) else None
                overhead[name] = value if per_task is None else per_task
        reasons_of(overhead, reasons)
        trip = thread_round_trip() * 1e6
        print(
            f"Overhead per task, tiny model (Linear(4, 4) per partition), P2 M32: "
            f"(time - plain) / (n * m), plain {plains[0] * 1e3:.2f} ms per step "
            f"({plains[1] * 1e3:.2f} ms with the pipe ways, timed after the others); in "
            f"round trips (RT) of a value between two threads, {trip:.1f} us here"
        )
        rows = []
        for way in WAYS[2:]:
            row = [way]
            for mode in ("never", "except_last"):
                value = overhead.get(f"{way} ({mode})")
                row.append(f"{value:.0f}" if isinstance(value, float) else "-")
                row.append(f"{value / trip:.2f}" if isinstance(value, float) else "-")
            rows.append(row)
        print_table(["way", "never us", "never RT", "except_last us", "except_last RT"], rows)
        floors = [
            f"{name} {value:.0f} us = {value / trip:.2f} RT"
            for name in ("plain mb", "plain mb cut")
            if isinstance(value := overhead.get(name), float)
        ]
        if floors:
            print(
                "  without a pipeline, in one thread, per task over plain: "
                + ", ".join(floors)
                + " (plain mb: the model on each micro-batch in turn, one backward call "
                "each; plain mb cut: cut at the partitions, one backward call per partition "
                "and micro-batch, as every step makes)"
            )
        base = overhead.get("step 1f1b (never)")
        for way, what, against in (
            ("step 1f1b BatchMean (never)", "a BatchMean loss (the mini-batch counted first)",
             "the plain mean"),
            ("step 1f1b dict input (never)", "a dict input ({'x': input})", "a tensor input"),
            *(
                (f"step {schedule} unwatched (never)",
                 f"without the one-turn watcher (step {schedule})", "it")
                for schedule in SCHEDULES
            ),
        ):  # fmt: skip
            value = overhead.get(way)
            reference = overhead.get(way.replace(" unwatched", "")) if "unwatched" in way else base
            if isinstance(reference, float) and isinstance(value, float):
                steps = [plains[0] + per_task * tasks / 1e6 for per_task in (reference, value)]
                against_base[way] = steps[1] / steps[0]
                schedule = "" if "unwatched" in way else ", step 1f1b"
                print(
                    f"  {what}{schedule}: {value:.0f} us per task over plain, {reference:.0f} us "
                    f"with {against}; step time ratio {against_base[way]:.3f}"
                )
        print()

        # One partition, one micro-batch ------------------------------------------------------
        single = replace(mlp, balance=[8], chunks=1)
        single_runners = {
            "plain": plain_runner(single),
            "fwd+bwd": gpipe_runners(single)["fwd+bwd"],
        }
        single_times = measure(single_runners, max(20, rounds * 2))
        single_ratio = single_times["fwd+bwd"] / single_times["plain"]
        print(
            f"One partition, chunks=1, no checkpointing (MLP): fwd+bwd / plain = "
            f"{single_ratio:.3f} (plain {ms(single_times['plain'])} ms)"
        )
        print()
    finally:
        ways.close()

    # Memory ----------------------------------------------------------------------------------
    mem_width = 256
    mem: dict[str, dict[str, Any]] = {}
    for n in (2, 4):
        case = Case(
            f"P{n} M8", "mlp", {"n": n, "width": mem_width}, [2] * n, 8, (64, mem_width), "mse"
        )
        mem[case.name] = memory(case)
    print(
        f"Saved-activation bytes (KiB), MLP of Linear({mem_width}, {mem_width}) + ReLU, two per "
        "partition, 8 rows per micro-batch, no checkpointing; theory: GPipe m x one "
        "micro-batch, 1F1B sum of min(n - j, m) micro-batches of partition j; parameters, input "
        "and target not counted"
    )
    rows = []
    for name, r in mem.items():
        for way in ("plain", "fwd+bwd", "step gpipe", "step 1f1b"):
            value = r[way]
            theory = r["theory 1f1b"] if way == "step 1f1b" else r["theory gpipe"]
            if isinstance(value, str):
                rows.append([f"{name} {way}", "-", "-", f"{theory / 1024:.0f}", "-", "-"])
                continue
            after, peak, left = value
            rows.append(
                [
                    f"{name} {way}",
                    "-" if after is None else f"{after / 1024:.0f}",
                    f"{peak / 1024:.0f}",
                    f"{theory / 1024:.0f}",
                    f"{peak / theory:.2f}",
                    f"{left / 1024:.0f}",
                ]
            )
    print_table(["case", "after fwd", "peak", "theory", "peak/theory", "left"], rows)
    print()

    print_unrun(reasons)

    # Targets ---------------------------------------------------------------------------------
    checks: list[Check] = [*default_checks, *ideal_checks(ideals, results, "step", 1.03)]
    r = results["MLP P2 M4"]
    for schedule in SCHEDULES:
        value = r.get(f"step {schedule}")
        checks.append(
            (
                f"MLP P2 M4: step {schedule} / plain <= 0.70",
                value / r["plain"] if isinstance(value, float) else None,
                0.70,
            )
        )
    # The machinery's cost alone (never), and with checkpointing's extra work (except_last).
    limits = {"never": (50.0, 100.0, 100.0), "except_last": (150.0, 150.0, 150.0)}
    for mode, mode_limits in limits.items():
        for way, limit in zip(("fwd+bwd", "step gpipe", "step 1f1b"), mode_limits, strict=True):
            value = overhead.get(f"{way} ({mode})")
            checks.append(
                (
                    f"tiny P2 M32 ({mode}): {way} overhead per task <= {limit:.0f} us",
                    value if isinstance(value, float) else None,
                    limit,
                )
            )
    # The same, in round trips between two threads (what the host charges per wake).
    for way, limit in (("fwd+bwd", 1.0), ("step gpipe", 1.5), ("step 1f1b", 1.5)):
        value = overhead.get(f"{way} ({'never'})")
        checks.append(
            (
                f"tiny P2 M32 (never): {way} overhead per task <= {limit:g} round trips",
                value / trip if isinstance(value, float) else None,
                limit,
            )
        )
    for name, r in mem.items():
        n = int(name[1])
        gpipe_peak, onef_peak = r["step gpipe"], r["step 1f1b"]
        if isinstance(gpipe_peak, str) or isinstance(onef_peak, str):
            checks.append((f"{name}: 1F1B peak <= n/m x GPipe peak + one micro-batch", None, 1))
            continue
        bound = n / 8 * gpipe_peak[1] + r["micro-batch"]
        checks.append(
            (
                f"{name}: 1F1B peak / (n/m x GPipe peak + one micro-batch) <= 1",
                onef_peak[1] / bound,
                1.0,
            )
        )
    checks.append(("one partition, chunks=1, never: fwd+bwd / plain <= 1.03", single_ratio, 1.03))
    for way, label in (
        ("step 1f1b BatchMean (never)", "with a BatchMean / with a plain mean"),
        ("step 1f1b dict input (never)", "with a dict input / with a tensor input"),
    ):
        checks.append(
            (f"tiny P2 M32 (never): step 1f1b {label} <= 1.05", against_base.get(way), 1.05)
        )

    print(
        f"At the end, two threads run {parallel_speedup():.2f}x as fast as one on independent "
        "matmuls"
    )
    print()
    print_targets(checks)


if __name__ == "__main__":
    main()
