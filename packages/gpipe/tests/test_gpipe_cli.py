"""Tests of the command line and the demo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpipe._cli import build_parser, main
from gpipe._demo import DemoConfig, run_demo

TINY = ["--steps", "3", "--batch-size", "16", "--chunks", "2", "--width", "16", "--no-progress"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Work uninstalled too: the child sees the packages this interpreter sees.
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _check_report(text: str) -> None:
    lines = text.splitlines()
    assert any(line.startswith("loss:") and "->" in line for line in lines), text
    assert any(line.startswith("throughput (gpipe):") and "samples/s" in line for line in lines)
    assert any(line.startswith("throughput (plain):") and "samples/s" in line for line in lines)
    assert any(line.startswith("devices:") for line in lines)


def test_main_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY]) == 0
    captured = capsys.readouterr()
    _check_report(captured.out)


def test_python_m_gpipe_demo() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpipe", "demo", *TINY, "--checkpoint", "always"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    _check_report(result.stdout)


@pytest.mark.parametrize("option", ["--chunks", "--steps", "--batch-size", "--width"])
def test_non_positive_arguments_exit_2(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", *TINY]
    argv[argv.index(option) + 1] = "0"
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert option in err
    assert f"({option}: 0)" in err


def test_bad_arguments_via_python_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpipe", "demo", "--chunks", "0", "--no-progress"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "--chunks" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [[], ["demo", "--chunks", "two"], ["demo", "--checkpoint", "sometimes"], ["nope"]],
)
def test_unusable_command_lines_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err


def test_parser_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert (args.steps, args.batch_size, args.chunks, args.width) == (300, 256, 4, 512)
    assert args.checkpoint == "except_last"
    assert args.no_progress is False


def test_run_demo_loss_decreases() -> None:
    # The recorded losses are single-batch losses of a narrow eight-layer network, which
    # learns slowly at first: 60 steps are not enough to see it, 200 are (seed 0).
    report = run_demo(DemoConfig(steps=200, batch_size=16, chunks=2, width=16, progress=False))
    assert report.first_loss > 0
    assert report.final_loss < report.first_loss
    assert report.pipelined_samples_per_s > 0
    assert report.plain_samples_per_s > 0
    assert len(report.devices) == 2
    text = report.format()
    assert f"{report.first_loss:.4f} -> {report.final_loss:.4f}" in text


def test_run_demo_is_deterministic_for_a_seed() -> None:
    config = DemoConfig(steps=3, batch_size=8, chunks=2, width=8, seed=5, progress=False)
    a = run_demo(config)
    b = run_demo(config)
    assert a.first_loss == b.first_loss
    assert a.final_loss == b.final_loss


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import gpipe

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gpipe {gpipe.__version__} (torch ")
    assert torch.__version__ in out
