"""Tests of the command line and the demo."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from gpipe._cli import build_parser, main
from gpipe._demo import Bound, DemoConfig, DemoReport, _bound, demo_setup, run_demo

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
    assert (args.steps, args.batch_size, args.chunks, args.width) == (60, 512, 4, 1024)
    assert args.checkpoint == "never"
    assert args.progress is None  # bars only on a terminal
    assert build_parser().parse_args(["demo", "--progress"]).progress is True
    assert build_parser().parse_args(["demo", "--no-progress"]).progress is False


def test_progress_options_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["demo", "--progress", "--no-progress"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_progress_bars_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Under pytest standard error is not a terminal: no bar by default, one when asked.
    run_demo(DemoConfig(steps=2, batch_size=8, chunks=2, width=8))
    assert "step" not in capsys.readouterr().err
    run_demo(DemoConfig(steps=2, batch_size=8, chunks=2, width=8, progress=True))
    assert "gpipe 1f1b" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_demo_in_one_process_trains_with_step(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpipe_core import GPipe

    calls: list[str] = []
    step = GPipe.step

    def spy(self: GPipe, *args: object, **kwargs: object) -> object:
        calls.append(str(kwargs["schedule"]))
        return step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(GPipe, "step", spy)
    config = DemoConfig(steps=3, batch_size=8, chunks=2, width=8, progress=False, schedule=schedule)
    report = run_demo(config)
    assert calls == [schedule] * 3
    assert report.final_loss > 0


def test_schedule_option_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["demo", "--steps", "2", "--batch-size", "8", "--width", "8", "--schedule", "gpipe"]
    )
    assert code == 0
    assert "gpipe / plain" in capsys.readouterr().out


def test_run_demo_loss_decreases() -> None:
    # The recorded losses are single-batch losses of a narrow ten-layer network, which
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
    # torch's distribution version, read without importing torch: the wheel's metadata,
    # which may lack the local label of torch.__version__ (torch 2.14.1's wheel says
    # 2.14.1, torch.__version__ 2.14.1+cu130; 2.13.0+cpu's says both).
    installed = importlib.metadata.version("torch")
    assert out == f"gpipe {gpipe.__version__} (torch {installed})\n"
    assert torch.__version__.split("+")[0] == installed.split("+")[0]


def test_report_gives_the_bound_and_why() -> None:
    report = DemoReport(
        devices=["cpu", "cpu"],
        first_loss=2.0,
        final_loss=1.0,
        pipelined_samples_per_s=900.0,
        plain_samples_per_s=1000.0,
        bound=Bound(1200.0, "1 of 2 threads", 1),
        chunks=4,
    )
    lines = report.format().splitlines()
    assert "throughput (bound): 1,200 samples/s (the best 2 workers can do here)" in lines
    (why,) = [line for line in lines if line.startswith("why: ")]
    assert "1 of 2 threads" in why and "at most 1.20x plain" in why and "75% of that" in why
    assert "recomputes" not in why
    recomputing = dataclasses.replace(report, checkpoint="except_last")
    assert "checkpoint='except_last' recomputes" in recomputing.why()


def test_bound_on_devices_of_their_own_and_shared() -> None:
    config = DemoConfig(chunks=4)
    own = [torch.device("cuda", 0), torch.device("cuda", 1)]
    bound = _bound(nn.Linear(1, 1), torch.zeros(1), torch.zeros(1), own, config, 1000.0)
    assert bound is not None and bound.threads is None
    assert bound.samples_per_s == pytest.approx(1000.0 * 2 * 4 / (4 + 2 - 1))
    shared = [torch.device("cuda", 0)] * 2
    assert _bound(nn.Linear(1, 1), torch.zeros(1), torch.zeros(1), shared, config, 1.0) is None


def test_bound_with_fewer_threads_than_partitions_is_plains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = [torch.device("cpu")] * 2
    bound = _bound(nn.Linear(1, 1), torch.zeros(1), torch.zeros(1), cpu, DemoConfig(), 1000.0)
    assert bound is not None and bound.samples_per_s == 1000.0 and bound.threads == 1


def test_bound_on_the_cpu_times_a_share_of_the_threads_and_sets_them_back() -> None:
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = DemoConfig(steps=3, batch_size=8, chunks=2, width=8)
        data, target, plain = demo_setup(config)
        cpu = [torch.device("cpu")] * 2
        bound = _bound(plain, data, target, cpu, config, 1.0)
        assert bound is not None and bound.threads == 1 and bound.each == "1 of 2 threads"
        assert bound.samples_per_s > 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
