"""The demo's --trace and --plot options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpipe._cli import build_parser, main
from gpipe._demo import DemoConfig, run_demo

TINY = ["--steps", "2", "--batch-size", "16", "--chunks", "4", "--width", "16", "--no-progress"]
PNG = b"\x89PNG\r\n\x1a\n"


def _check_trace(path: Path, partitions: int = 2, chunks: int = 4) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    forward = {(e["args"]["partition"], e["args"]["microbatch"]) for e in complete
               if e["cat"] == "forward"}  # fmt: skip
    assert forward == {(j, i) for j in range(partitions) for i in range(chunks)}
    assert {e["cat"] for e in complete} >= {"forward", "backward"}
    assert any(e["ph"] == "s" for e in data["traceEvents"])


def test_trace_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace, plot = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["demo", *TINY, "--trace", str(trace), "--plot", str(plot)]) == 0
    _check_trace(trace)
    assert plot.read_bytes()[:8] == PNG
    out = capsys.readouterr().out
    assert f"wrote {trace}" in out and f"wrote {plot}" in out
    assert "in theory" in out


def test_trace_alone_needs_no_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace = tmp_path / "out.json"
    assert main(["demo", *TINY, "--trace", str(trace)]) == 0
    _check_trace(trace)
    assert "bubble" in capsys.readouterr().out


def test_plot_without_matplotlib_exits_2_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    plot = tmp_path / "out.png"
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, "--plot", str(plot)])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "pip install dist/gpipe-*.whl dist/gpipe_core-*.whl" in captured.err
    assert 'dist/gpipe_microbatch-*.whl "gpipe[plot]"' in captured.err
    assert f"--plot: {plot})" in captured.err
    assert captured.out == ""
    assert not plot.exists()


def test_no_trace_by_default() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.trace is None and args.plot is None
    report = run_demo(DemoConfig(steps=2, batch_size=8, chunks=2, width=8, progress=False))
    assert report.timeline is None and report.written == ()
    assert "bubble" not in report.format()


def test_python_m_gpipe_demo_trace(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    env.setdefault("OMP_NUM_THREADS", "1")
    trace = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "gpipe", "demo", *TINY, "--trace", str(trace)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    _check_trace(trace)
