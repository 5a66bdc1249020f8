"""The ``gpipe`` command line: ``python -m gpipe demo``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from .__about__ import __version__

__all__ = ["build_parser", "main"]

# The README's install with the plot extra, as it gives it (the build session checks it).
_PLOT_INSTALL = 'pip install dist/gpipe-*.whl dist/gpipe_core-*.whl dist/gpipe_skip-*.whl dist/gpipe_bn-*.whl dist/gpipe_balance-*.whl dist/gpipe_checkpoint-*.whl dist/gpipe_microbatch-*.whl "gpipe[plot]"'  # noqa: E501

#: The layers of the demo's network (``gpipe._demo.LAYERS``, without importing torch).
LAYERS = 10
#: The options that only the demo across processes takes.
_PROCESSES_ONLY = {
    "log_every": "the demo in one process has no other process to wait for or log",
    "timeout": "the demo in one process has no other process to wait for or log",
    "tied": "the demo in one process compares the plain network, on one device, untied",
}


def _torch_version() -> str:
    """The installed torch's version, read without importing torch."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m gpipe``."""
    parser = argparse.ArgumentParser(
        prog="python -m gpipe", description="GPipe pipeline parallelism for PyTorch."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"gpipe {__version__} (torch {_torch_version()})",
        help="print gpipe's and torch's versions and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small network pipelined over two partitions, or across processes",
        description=(
            "Train a small sequential network on synthetic data, pipelined over two "
            "partitions (GPUs when there are two, the CPU otherwise), then compare its "
            "throughput with the same network without pipelining. With --processes N, the "
            "partitions run in N local processes (gloo on 127.0.0.1, one intra-op thread "
            "each), and the throughput is compared with the same pipeline in one process; "
            "under torchrun (torchrun --standalone --nproc-per-node 2 -m gpipe demo "
            "--processes 2) the demo runs in torchrun's processes instead of starting its own."
        ),
    )
    demo.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    demo.add_argument("--batch-size", type=int, default=512, help="mini-batch size (default: 512)")
    demo.add_argument("--chunks", type=int, default=4, help="micro-batches (default: 4)")
    demo.add_argument("--width", type=int, default=1024, help="hidden width (default: 1024)")
    demo.add_argument(
        "--checkpoint",
        choices=["always", "except_last", "never"],
        default="never",
        help="checkpointing mode (default: never: the network fits in memory)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument(
        "--partitions",
        type=int,
        help=f"partitions (default: 2, or --processes); a multiple of --processes, at most "
        f"{LAYERS}, the network's layers",
    )
    demo.add_argument(
        "--processes",
        type=int,
        help="run the partitions in this many local processes and compare with one process "
        "(default: 1, or WORLD_SIZE under torchrun)",
    )
    demo.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe"],
        help="the schedule of each training step, GPipe.step (default: 1f1b)",
    )
    demo.add_argument(
        "--log-every",
        type=int,
        metavar="K",
        help="with --processes: print the loss of every K-th step, and of the first and the "
        "last (default: 10)",
    )
    demo.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="with --processes: how long any wait for another process may last (default: 300)",
    )
    demo.add_argument(
        "--tied",
        action="store_true",
        default=None,
        help="with --processes: the first and the last hidden layers share one weight (tied "
        "across partitions, as a language model's embedding and output head), and the "
        "gradients are clipped to a total norm of 1",
    )
    progress = demo.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        action="store_true",
        default=None,
        help="show the progress bars (default: only when standard error is a terminal)",
    )
    progress.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide the progress bars"
    )
    demo.add_argument(
        "--trace",
        metavar="PATH",
        help="record one more pipelined step and write its Chrome/Perfetto trace (JSON) here",
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="record one more pipelined step and draw its timeline here (PNG, SVG or PDF; "
        "needs matplotlib: pip install matplotlib)",
    )
    return parser


def _has_matplotlib() -> bool:
    try:
        import_module("matplotlib")
    except ImportError:
        return False
    return True


def _rank_command(argv: Sequence[str]) -> list[str]:
    """The command each rank of ``--processes`` runs: this same command line (each rank
    sees its ``RANK`` and ``WORLD_SIZE``, so it joins the group rather than launching)."""
    return [sys.executable, "-m", "gpipe", *argv]


def _launched_world() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when this process is a rank that torchrun (or the demo's
    launcher) started, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        build_parser().error(
            f"RANK and WORLD_SIZE must be integers (RANK: {os.environ['RANK']!r}, "
            f"WORLD_SIZE: {os.environ['WORLD_SIZE']!r})"
        )
    if not 0 <= rank < world:
        build_parser().error(
            f"RANK must be between 0 and WORLD_SIZE - 1 (RANK: {rank}, WORLD_SIZE: {world})"
        )
    return rank, world


def _check_demo(args: argparse.Namespace, launched: tuple[int, int] | None) -> None:
    """Fill in the defaults of ``--processes`` and ``--partitions``; refuse a demo command
    line that cannot run, with an argparse error (status 2)."""
    error = build_parser().error
    for name in ("steps", "batch_size", "chunks", "width", "processes", "partitions"):
        value = getattr(args, name)
        option = "--" + name.replace("_", "-")
        if value is not None and value <= 0:
            error(f"{option} must be a positive integer ({option}: {value})")
    if args.processes is None:
        args.processes = 1 if launched is None else launched[1]
    if args.partitions is None:
        args.partitions = 2 if args.processes == 1 else args.processes
    processes, partitions = args.processes, args.partitions
    if launched is not None and processes != launched[1]:
        error(
            "--processes must be WORLD_SIZE, the number of processes torchrun started "
            f"(--processes: {processes}, WORLD_SIZE: {launched[1]})"
        )
    if processes > LAYERS:
        error(
            f"--processes must be at most {LAYERS}, the demo network's layers, for one "
            f"partition or more per process (--processes: {processes})"
        )
    if partitions > LAYERS:
        error(
            f"--partitions must be at most {LAYERS}, the demo network's layers "
            f"(--partitions: {partitions})"
        )
    if partitions % processes:
        error(
            "--partitions must be a multiple of --processes, one partition or more per "
            f"process (--partitions: {partitions}, --processes: {processes})"
        )
    if processes == 1:
        for name, why in _PROCESSES_ONLY.items():
            value = getattr(args, name)
            option = "--" + name.replace("_", "-")
            if value is not None:
                error(f"{option} goes with --processes 2 or more: {why} ({option}: {value})")
    else:
        for name in ("trace", "plot"):
            value = getattr(args, name)
            if value is not None:
                error(
                    f"--{name} records a step in one process; it does not go with "
                    f"--processes {processes} (--{name}: {value})"
                )
        if args.log_every is not None and args.log_every <= 0:
            error(f"--log-every must be a positive integer (--log-every: {args.log_every})")
        if args.timeout is not None and not args.timeout > 0:
            error(f"--timeout must be a positive number of seconds (--timeout: {args.timeout})")
    if args.plot is not None and not _has_matplotlib():
        error(
            f"--plot needs matplotlib: pip install matplotlib (or, from a checkout with the "
            f"wheels built into dist/: {_PLOT_INSTALL}; --plot: {args.plot})"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        launched = _launched_world()
        _check_demo(args, launched)
        if args.processes > 1 and launched is None:
            from ._launch import launch

            return launch(_rank_command(argv), args.processes)

        from ._demo import DemoConfig, run_demo

        config = DemoConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            chunks=args.chunks,
            width=args.width,
            checkpoint=args.checkpoint,
            seed=args.seed,
            progress=args.progress,
            trace=args.trace,
            plot=args.plot,
            partitions=args.partitions,
            processes=args.processes,
            schedule=args.schedule or "1f1b",
            log_every=args.log_every or 10,
            timeout=args.timeout or 300.0,
            tied=bool(args.tied),
        )
        if args.processes > 1:
            from ._demo_processes import rank_main

            assert launched is not None
            return rank_main(config, *launched)
        report = run_demo(config)
        print(report.format())
        return 0
    raise AssertionError(f"unknown command: {args.command}")
