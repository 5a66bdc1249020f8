"""The ``gpipe`` command line: ``python -m gpipe demo``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import import_module

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m gpipe``."""
    parser = argparse.ArgumentParser(
        prog="python -m gpipe", description="GPipe pipeline parallelism for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small network pipelined over two partitions",
        description=(
            "Train a small sequential network on synthetic data, pipelined over two "
            "partitions (GPUs when there are two, the CPU otherwise), then compare its "
            "throughput with the same network without pipelining."
        ),
    )
    demo.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    demo.add_argument("--batch-size", type=int, default=256, help="mini-batch size (default: 256)")
    demo.add_argument("--chunks", type=int, default=4, help="micro-batches (default: 4)")
    demo.add_argument("--width", type=int, default=512, help="hidden width (default: 512)")
    demo.add_argument(
        "--checkpoint",
        choices=["always", "except_last", "never"],
        default="except_last",
        help="checkpointing mode (default: except_last)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import DemoConfig, run_demo

        config = DemoConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            chunks=args.chunks,
            width=args.width,
            checkpoint=args.checkpoint,
            seed=args.seed,
            progress=not args.no_progress,
            trace=args.trace,
            plot=args.plot,
        )
        for name, value in (
            ("steps", config.steps),
            ("batch-size", config.batch_size),
            ("chunks", config.chunks),
            ("width", config.width),
        ):
            if value <= 0:
                build_parser().error(f"--{name} must be a positive integer (--{name}: {value})")
        if config.plot is not None and not _has_matplotlib():
            build_parser().error(
                f"--plot needs matplotlib: pip install matplotlib (or, from a checkout with the "
                'wheels built into dist/: pip install dist/*.whl "gpipe[plot]"; '
                f"--plot: {config.plot})"
            )
        report = run_demo(config)
        print(report.format())
        return 0
    raise AssertionError(f"unknown command: {args.command}")
