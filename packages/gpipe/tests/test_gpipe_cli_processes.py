"""The demo across processes: ``python -m gpipe demo --processes N``.

Each run gets a marker in its environment, which every process it starts inherits; after
the run, no process may still carry it (every rank reaped, also on failure and Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import TextIO

import pytest

from gpipe._cli import build_parser, main
from gpipe._launch import launch

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc (Linux)"
)

TINY = ["--steps", "2", "--batch-size", "16", "--chunks", "2", "--width", "16", "--no-progress"]
#: Bounds every run of a test: a hung demo fails the test instead of hanging it.
TIMEOUT = 240
MARK = "GPIPE_TEST_DEMO_MARK"


def _demo(*args: str) -> list[str]:
    """``python -m gpipe demo --processes 2``, small, with ``args``."""
    return [sys.executable, "-m", "gpipe", "demo", "--processes", "2", *TINY, *args]


def _env(mark: str) -> dict[str, str]:
    env = dict(os.environ)
    # Work uninstalled too: the children see the packages this interpreter sees.
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    env[MARK] = mark
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _marked(mark: str) -> dict[int, dict[str, str]]:
    """The processes whose environment carries ``mark``: pid -> environment."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":  # exited; its parent will reap it
            continue
        env = dict(
            item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
        )
        if env.get(MARK) == mark:
            found[int(entry.name)] = env
    return found


def _assert_no_leftover(mark: str) -> None:
    deadline = time.monotonic() + 10
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marked(mark)
    for pid in left:  # do not leave them behind for the next tests
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"


class Demo:
    """``command`` running with a marker; ends it (and what it started) in :meth:`close`."""

    def __init__(self, command: list[str], tmp: Path | None = None) -> None:
        self.mark = uuid.uuid4().hex
        env = _env(self.mark)
        if tmp is not None:  # its temporary directory
            env["TMPDIR"] = str(tmp)
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def wait_for_line(self, pattern: str) -> list[str]:
        """Read standard output until a line matches ``pattern``; the lines read."""
        assert self.process.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if re.search(pattern, line):
                return lines
        raise AssertionError(f"no line matching {pattern!r}: {lines[-20:]}")

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the ranks the demo started."""
        ranks = {}
        for pid, env in _marked(self.mark).items():
            if pid != self.process.pid and "RANK" in env:
                ranks[int(env["RANK"])] = pid
        return ranks

    def finish(self) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=TIMEOUT)
        return self.process.returncode, out, err

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
        _assert_no_leftover(self.mark)


def _run(command: list[str]) -> tuple[int, str, str]:
    demo = Demo(command)
    try:
        return demo.finish()
    finally:
        demo.close()


def _no_third_party_warnings(err: str) -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:  # torch warns at import without NumPy: not the demo's doing
        return
    assert "Warning" not in err, err
    assert "[W" not in err, err  # c10d's and gloo's warnings


def _value(out: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}:\s+(.*)$", out, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{out}"
    return match.group(1)


def test_demo_across_two_processes() -> None:
    code, out, err = _run(_demo("--log-every", "1"))
    assert code == 0, err
    assert out.startswith("gpipe across 2 processes (gloo, 127.0.0.1:"), out
    assert "balance [5, 5], 2 micro-batches, schedule 1f1b" in out
    losses = re.findall(r"^step (\d)/2  loss (\d+\.\d{4})$", out, re.MULTILINE)
    assert [step for step, _ in losses] == ["1", "2"], out
    assert _value(out, "processes") == "2 (gloo), partition 0 -> rank 0, 1 -> rank 1"
    # The same network on the same data: the same losses across processes and in one.
    loss = _value(out, "loss")
    assert loss == f"{losses[0][1]} -> {losses[1][1]}"
    assert _value(out, "loss (1 process)") == loss
    assert re.fullmatch(r"[\d,]+ samples/s", _value(out, "throughput (2 processes)"))
    assert re.fullmatch(r"[\d,]+ samples/s", _value(out, "throughput (1 process)"))
    assert re.fullmatch(r"\d+\.\d\dx", _value(out, "2 processes / 1 process"))
    _no_third_party_warnings(err)


def test_two_partitions_per_process_and_gpipe_schedule() -> None:
    code, out, err = _run(
        _demo("--partitions", "4", "--schedule", "gpipe", "--checkpoint", "always")
    )
    assert code == 0, err
    assert "balance [3, 3, 2, 2], 2 micro-batches, schedule gpipe" in out
    assert _value(out, "processes") == (
        "2 (gloo), partition 0 -> rank 0, 1 -> rank 1, 2 -> rank 0, 3 -> rank 1"
    )
    # The first step and the last (the default: every 10th step, the first and the last).
    assert re.findall(r"^step (\d)/2", out, re.MULTILINE) == ["1", "2"]
    assert _value(out, "loss (1 process)") == _value(out, "loss")


def test_tied_weights_across_processes_train_as_in_one_process() -> None:
    """Layers 2 and 8 share one weight, in partitions on ranks 0 and 1, with the gradients
    clipped over the whole pipeline: the same losses as one process, at every step."""
    code, out, err = _run(_demo("--tied", "--log-every", "1", "--steps", "3"))
    assert code == 0, err
    assert "layers 2 and 8 tied, gradients clipped to norm 1" in out
    losses = re.findall(r"^step (\d)/3  loss (\d+\.\d{4})$", out, re.MULTILINE)
    assert [step for step, _ in losses] == ["1", "2", "3"], out
    assert _value(out, "loss") == f"{losses[0][1]} -> {losses[2][1]}"
    assert _value(out, "loss (1 process)") == _value(out, "loss")
    _no_third_party_warnings(err)


def test_torchrun_starts_the_ranks(tmp_path: Path) -> None:
    # --standalone: a free port (torchrun's default, 29500, may be taken by another run).
    # --log-dir: torchrun's files go there, not into a folder of the temporary directory.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "--log-dir", str(tmp_path)]
    code, out, err = _run([*torchrun, "-m", "gpipe", "demo", "--processes", "2", *TINY])
    assert code == 0, err
    assert out.startswith("gpipe across 2 processes (gloo, "), out
    assert out.count("throughput (2 processes):") == 1  # rank 0 reports, the others don't
    assert _value(out, "loss (1 process)") == _value(out, "loss")


def test_torchrun_agents_meet_as_two_hosts_would(tmp_path: Path) -> None:
    """The docs' several-host command with both "hosts" here: two torchrun agents, one rank
    each, meet at a c10d rendezvous on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    torchrun += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    torchrun += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex]
    torchrun += ["--log-dir", str(tmp_path)]
    command = [*torchrun, "-m", "gpipe", "demo", "--processes", "2", *TINY]
    agents = [Demo(command) for _ in range(2)]
    try:
        results = [agent.finish() for agent in agents]
    finally:
        for agent in agents:
            agent.close()
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    reports = [out for _, out, _ in results if "throughput (2 processes):" in out]
    assert len(reports) == 1, results  # rank 0's agent reports, the other does not
    assert _value(reports[0], "processes") == "2 (gloo), partition 0 -> rank 0, 1 -> rank 1"
    assert _value(reports[0], "loss (1 process)") == _value(reports[0], "loss")


FAILING = """
    import os
    import sys

    from gpipe import _cli, _demo_processes

    setup = _demo_processes.demo_setup


    def failing_setup(config):
        data, target, model = setup(config)
        if os.environ.get("RANK") == "1":
            calls = []

            def hook(module, inputs, output):
                calls.append(None)
                if len(calls) > 3:  # a step is 3 forward passes here (2, 1 recomputed)
                    raise ValueError("boom on rank 1")

            model[5].register_forward_hook(hook)
        return data, target, model


    _demo_processes.demo_setup = failing_setup
    _cli._rank_command = lambda argv: [sys.executable, __file__, *argv]
    raise SystemExit(_cli.main())
"""


def test_failing_rank_fails_the_demo_with_its_error(tmp_path: Path) -> None:
    script = tmp_path / "failing_demo.py"
    script.write_text(textwrap.dedent(FAILING), encoding="utf-8")
    start = time.monotonic()
    command = [sys.executable, str(script), *_demo("--steps", "5", "--log-every", "1")[3:]]
    code, out, err = _run([*command, "--timeout", "60"])
    assert code == 1, (out, err)
    assert time.monotonic() - start < 60 + 30
    assert "step 1/5" in out and "step 2/5" not in out
    assert "throughput" not in out
    # The failing rank's own error, with its traceback, not rank 0's report of it.
    assert err.count("error: rank 1 of 2 failed") == 1, err
    assert "ValueError: boom on rank 1" in err
    assert "Traceback (most recent call last)" in err
    assert "RemotePartitionError" not in err


def test_killed_rank_fails_the_demo() -> None:
    demo = Demo(_demo("--steps", "100000", "--log-every", "1", "--timeout", "60"))
    try:
        demo.wait_for_line(r"^step +2/")
        ranks = demo.ranks()
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        code, _, err = demo.finish()
        assert code == 1
        assert "error: rank 1 of 2 was killed by SIGKILL without reporting an error" in err
    finally:
        demo.close()


@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_interrupt_stops_every_rank(signum: int, code: int, said: str) -> None:
    demo = Demo(_demo("--steps", "100000", "--log-every", "1"))
    try:
        demo.wait_for_line(r"^step +2/")
        assert sorted(demo.ranks()) == [0, 1]
        demo.process.send_signal(signum)  # the launcher only, as kill would
        returncode, _, err = demo.finish()
        assert returncode == code
        assert f"{said}: stopped the 2 ranks" in err
    finally:
        demo.close()


def test_ranks_end_when_the_launcher_is_killed(tmp_path: Path) -> None:
    # A launcher killed cannot remove its folder of the ranks' files: it is left in tmp_path.
    demo = Demo(_demo("--steps", "100000", "--log-every", "1"), tmp=tmp_path)
    try:
        demo.wait_for_line(r"^step +2/")
        ranks = demo.ranks()
        assert sorted(ranks) == [0, 1]
        demo.process.kill()  # no chance to stop them: they see their standard input close
        demo.process.wait()
        deadline = time.monotonic() + 30
        while any(pid in _marked(demo.mark) for pid in ranks.values()):
            assert time.monotonic() < deadline, "the ranks outlived their launcher"
            time.sleep(0.1)
    finally:
        demo.close()


RANKS = """
    import os, sys, time
    from gpipe._launch import report_error
    from gpipe_core import RemotePartitionError
    rank = int(os.environ["RANK"])
    assert os.environ["WORLD_SIZE"] == "3" and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert os.environ["OMP_NUM_THREADS"] == "1"
    try:
        if rank == {failing}:
            time.sleep(1.0)  # the others are told first: still this one is shown
            raise ValueError("rank {failing}'s own error")
        if rank == 0:
            raise RemotePartitionError({failing}, "the step", "ValueError: told", "")
    except Exception as error:
        assert report_error(error)
        sys.exit(1)
    time.sleep(600)  # stopped by the launcher
"""


def test_launcher_reports_the_failing_rank_not_the_told_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Rank 0 is told of rank 2's failure first; it waits (``grace``), so the agent sees
    rank 2 end first, and the report is rank 2's own error."""
    mark = uuid.uuid4().hex
    script = textwrap.dedent(RANKS).format(failing=2)
    start = time.monotonic()
    code = launch([sys.executable, "-c", script], 3, grace=30.0, env=_env(mark))
    assert code == 1
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert "error: rank 2 of 3 failed (then ranks [0, 1] were stopped):" in err, err
    assert "ValueError: rank 2's own error" in err
    assert "Traceback (most recent call last)" in err
    _assert_no_leftover(mark)


def test_launcher_prefers_a_rank_own_error_to_the_told_ones() -> None:
    """Of the errors written, a rank's own error wins over another rank's report of it,
    whichever the agent saw first."""
    from gpipe._launch import _failure

    class Failure:
        def __init__(self, exitcode: int, message: str) -> None:
            self.exitcode = exitcode
            self.message = {"message": message, "extraInfo": {"py_callstack": message + "\n"}}

    failures = {
        0: Failure(1, "RemotePartitionError: rank 1 failed in the step"),
        1: Failure(1, "ValueError: boom"),
    }
    assert _failure(failures, 2) == "error: rank 1 of 2 failed:\nValueError: boom"
    assert _failure({0: failures[0]}, 2).startswith("error: rank 0 of 2 failed:")


def test_launcher_reports_a_rank_that_died_silently(capsys: pytest.CaptureFixture[str]) -> None:
    mark = uuid.uuid4().hex
    script = textwrap.dedent(
        """
        import os, time
        from gpipe._launch import report_error
        if os.environ["RANK"] == "1":
            os._exit(7)  # no report: killed, crashed, or gone before it could say
        try:
            time.sleep(0.3)  # then rank 0 fails because of it, with an error of its own
            raise RuntimeError("rank 1 is gone")
        except RuntimeError as error:
            report_error(error)
        raise SystemExit(1)
        """
    )
    assert launch([sys.executable, "-c", script], 2, env=_env(mark)) == 1
    err = capsys.readouterr().err
    assert err == "error: rank 1 of 2 exited with status 7 without reporting an error\n"
    _assert_no_leftover(mark)


def test_launcher_all_ranks_succeed() -> None:
    mark = uuid.uuid4().hex
    code = launch(
        [sys.executable, "-c", "import os; assert os.environ['RANK'] in '01'"], 2, env=_env(mark)
    )
    assert code == 0
    _assert_no_leftover(mark)


def test_launcher_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's folder for the ranks' error files goes when the run ends, whether the
    ranks succeed or one fails (the agent alone would leave one ``torchelastic_*`` folder
    in the temporary directory per run)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mark = uuid.uuid4().hex
    env = {**_env(mark), "TMPDIR": str(tmp_path)}
    ok = "import os; assert os.environ['RANK'] in '01'"
    assert launch([sys.executable, "-c", ok], 2, env=env) == 0
    failing = textwrap.dedent(
        """
        import os
        from gpipe._launch import report_error
        try:
            raise ValueError(f"rank {os.environ['RANK']} fails")
        except ValueError as error:
            report_error(error)
        raise SystemExit(1)
        """
    )
    err = io.StringIO()
    assert launch([sys.executable, "-c", failing], 2, env=env, stderr=err) == 1
    assert "ValueError: rank" in err.getvalue(), err.getvalue()  # read before the removal
    assert list(tmp_path.iterdir()) == []
    _assert_no_leftover(mark)


def test_parser_defaults_for_processes() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.processes is None and args.partitions is None
    assert args.schedule is None and args.log_every is None and args.timeout is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--processes", "0"], "--processes must be a positive integer (--processes: 0)"),
        (["--processes", "-2"], "--processes must be a positive integer (--processes: -2)"),
        (["--processes", "11"], "--processes must be at most 10, the demo network's layers"),
        (["--processes", "two"], "argument --processes: invalid int value: 'two'"),
        (["--partitions", "0"], "--partitions must be a positive integer (--partitions: 0)"),
        (["--partitions", "11"], "--partitions must be at most 10, the demo network's layers"),
        (
            ["--processes", "2", "--partitions", "3"],
            "--partitions must be a multiple of --processes, one partition or more per "
            "process (--partitions: 3, --processes: 2)",
        ),
        (
            ["--processes", "4", "--partitions", "2"],
            "(--partitions: 2, --processes: 4)",
        ),
        (["--processes", "1", "--log-every", "5"], "--log-every goes with --processes 2 or more"),
        (["--timeout", "9"], "--timeout goes with --processes 2 or more"),
        (["--tied"], "--tied goes with --processes 2 or more: the demo in one process"),
        (["--processes", "2", "--schedule", "zigzag"], "argument --schedule: invalid choice"),
        (
            ["--processes", "2", "--log-every", "0"],
            "--log-every must be a positive integer (--log-every: 0)",
        ),
        (
            ["--processes", "2", "--timeout", "0"],
            "--timeout must be a positive number of seconds (--timeout: 0.0)",
        ),
        (
            ["--processes", "2", "--trace", "out.json"],
            "--trace records a step in one process; it does not go with --processes 2",
        ),
    ],
)
def test_bad_processes_arguments_exit_2(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # a --trace that would be written lands here
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""
    assert not list(tmp_path.iterdir())


def test_processes_must_match_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, "--processes", "3"])
    assert info.value.code == 2
    assert (
        "--processes must be WORLD_SIZE, the number of processes torchrun started "
        "(--processes: 3, WORLD_SIZE: 2)"
    ) in capsys.readouterr().err


def test_bad_processes_via_python_m() -> None:
    code, out, err = _run([sys.executable, "-m", "gpipe", "demo", "--processes", "0"])
    assert code == 2
    assert "--processes must be a positive integer (--processes: 0)" in err
    assert out == ""


def test_no_leftover_helper_sees_marked_processes() -> None:
    # The check above is only worth something if it finds a process that is left.
    mark = uuid.uuid4().hex
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=_env(mark)
    )
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in _marked(mark)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sleeper.pid not in _marked(mark)


def test_report_error_writes_torch_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from gpipe._launch import _errors, report_error

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    try:
        raise KeyError("k")
    except KeyError as error:
        assert not report_error(error)  # not a launched rank: nothing written
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))
    try:
        raise KeyError("k")
    except KeyError as error:
        assert report_error(error)
    # What the agent makes of it, and the launcher of that.
    failure = ProcessFailure(local_rank=3, pid=1, exitcode=1, error_file=str(tmp_path / "e.json"))
    (read,) = _errors({3: failure})
    assert read.rank == 3 and read.reported and not read.remote
    assert read.message == "KeyError: 'k'" and "raise KeyError" in read.traceback


def test_an_error_file_is_never_read_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank stopped while it writes its error file (the agent stops a told rank as soon
    as another has failed) leaves no file rather than half of one, which the agent could
    not parse (it raised JSONDecodeError instead of naming the rank that failed)."""
    import json

    from gpipe._launch import report_error

    def stopped_while_writing(data: object, f: TextIO) -> None:
        text = json.dumps(data)
        f.write(text[: len(text) // 2])
        raise SystemExit(143)  # what the rank's SIGTERM handler raises

    target = tmp_path / "e.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))
    monkeypatch.setattr(json, "dump", stopped_while_writing)
    with pytest.raises(SystemExit):
        try:
            raise KeyError("k")
        except KeyError as error:
            report_error(error)
    assert not target.exists()


def test_report_format() -> None:
    from gpipe._demo_processes import ProcessesReport

    report = ProcessesReport(
        processes=2,
        balance=[4, 4],
        partition_ranks=[0, 1],
        losses=[2.5, 2.0, 1.25],
        single_losses=[2.5, 2.0, 1.25],
        samples_per_s=3000.0,
        single_samples_per_s=2000.0,
    )
    text = report.format()
    assert text.splitlines()[:6] == [
        "processes:                2 (gloo), partition 0 -> rank 0, 1 -> rank 1",
        "loss:                     2.5000 -> 1.2500",
        "loss (1 process):         2.5000 -> 1.2500",
        "throughput (2 processes): 3,000 samples/s",
        "throughput (1 process):   2,000 samples/s",
        "2 processes / 1 process:  1.50x",
    ]
    assert "share this host's CPU" in text
    # Ranks on several hosts (torchrun's LOCAL_WORLD_SIZE below the world's): no such note.
    several = dataclasses.replace(report, one_host=False)
    assert "note:" not in several.format()


def test_layers_known_to_the_command_line() -> None:
    from gpipe import _cli, _demo

    assert _cli.LAYERS == _demo.LAYERS == len(_demo.build_model(4))
