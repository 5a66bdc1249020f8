"""Ranks in processes of their own: :func:`run` starts ``world`` processes in one gloo group
on ``127.0.0.1``, each running one case of :mod:`hf_support.cases`, and returns their
results; a rank that raises or does not finish within ``timeout`` fails the call, and every
process is killed and reaped whatever happens.

Run as a script, it is one rank: ``ranks.py CASE RANK WORLD PORT OUT`` (the case's
keyword arguments as a pickle on stdin, its result written to ``OUT``).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent


class RankFailed(AssertionError):
    """A rank raised, or did not finish in time."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(case: str, world: int = 2, timeout: float = 240.0, **kwargs: Any) -> list[Any]:
    """Each rank's result of ``cases.<case>(rank, world, **kwargs)``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    port = _free_port()
    with tempfile.TemporaryDirectory() as folder:
        outs = [Path(folder, f"rank{rank}.pkl") for rank in range(world)]
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, case, str(rank), str(world), str(port), str(out)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
            )
            for rank, out in enumerate(outs)
        ]
        try:
            for process in processes:
                assert process.stdin is not None
                process.stdin.write(pickle.dumps(kwargs))
                process.stdin.close()
            deadline = time.monotonic() + timeout
            for process in processes:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RankFailed(f"case {case} did not finish within {timeout} s") from None
            results = []
            for rank, (process, out) in enumerate(zip(processes, outs, strict=True)):
                assert process.stdout is not None
                log = process.stdout.read().decode(errors="replace")
                if not out.exists():
                    raise RankFailed(f"rank {rank} of case {case} wrote no result:\n{log[-4000:]}")
                ok, value = pickle.loads(out.read_bytes())
                if not ok:
                    raise RankFailed(f"rank {rank} of case {case} raised:\n{value}")
                results.append(value)
            return results
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
                if process.stdout is not None:
                    process.stdout.close()


def _main() -> None:
    case, rank, world, port, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    kwargs = pickle.loads(sys.stdin.buffer.read())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        from hf_support import cases

        result: tuple[bool, Any] = (True, getattr(cases, case)(rank, world, **kwargs))
    except BaseException:
        result = (False, traceback.format_exc())
    Path(out).write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
