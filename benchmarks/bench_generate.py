"""Generation through a pipeline: ``pipe.generate`` against the model's own ``generate`` and
transformers' own pipeline split, in new tokens per second.

Run it as a script (``python benchmarks/bench_generate.py``, ``--quick`` for a short run), or
with ``nox -s bench``. The model is a Llama-style causal LM built from ``LlamaConfig`` with
random weights (8 decoder layers, hidden size 256, MLP 704, 4 heads, vocabulary 8192, sdpa
attention, float32). It generates greedily from 8 prompts of 32 tokens, 64 new tokens each
(no end token, so that every way generates them all). Every way's tokens are compared with
the model's own once, before the timing; then the ways are timed round by round, each going
first in turn, and the medians are printed.

- **In one process** (the machine's default intra-op threads): ``model.generate`` against
  ``pipeline(model, balance=[4, 4], chunks=1).generate`` (two partitions on the CPU).
- **Across 2 gloo processes** (one intra-op thread each, one partition each): transformers'
  ``apply_pipeline_parallelism`` on a device mesh of the two ranks (``hf pp``: the model's
  own ``generate`` on every rank, each rank computing in turn, the logits broadcast from
  the last) against ``pipeline(model, group=WORLD, chunks=c).generate`` at ``c`` = 1, 2
  and 4 (``gpipe cN``: ``c`` lanes in flight).

Memory: each rank's key-value cache at the end of a generation (the bytes its lanes'
caches hold) against the whole model's cache in ``model.generate``.

Targets, printed as PASS or FAIL lines (a FAIL does not change the exit status; a way that
fails to run makes the script exit 1): across processes ``gpipe c2`` at least 1.6x ``hf pp``
(two lanes on two ranks allow 2x) and ``gpipe c1`` at least ``hf pp``; in one process at
least 0.9x ``model.generate``. Every wait for another process is bounded; every process is
ended and reaped, also on failure. Only ratios within one run are meaningful.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, PROMPT, NEW = 8, 32, 64
GPIPE_LANES = (1, 2, 4)
#: A larger batch, where a decode step's arithmetic counts: what lanes buy there.
LARGE_BATCH, LARGE_LANES = 64, (1, 2)


def build(quick: bool) -> Any:
    """The benchmark's model (the same weights in every process: seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8192 if not quick else 1024, hidden_size=256 if not quick else 64,
        intermediate_size=704 if not quick else 128, num_hidden_layers=8 if not quick else 4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def prompts(vocab: int, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def options(new: int) -> dict[str, Any]:
    return {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}


def cache_bytes(cache: Any) -> int:
    """The bytes a transformers cache holds in its layers' keys and values."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def pipeline_cache_bytes(pipe: Any, ids: torch.Tensor, new: int) -> int:
    """The bytes this process's lanes' caches hold at the end of ``pipe``'s generation
    (seen in the last call of each decoder layer)."""
    from gpipe_core import lane_state
    from gpipe_transformers import _pieces

    seen: dict[int, int] = {}
    forward = _pieces.Decoder.forward

    def watched(self: Any, carry: Any) -> Any:
        output = forward(self, carry)
        state = lane_state(self._config)
        if state is not None and "cache" in state:
            seen[id(state)] = cache_bytes(state["cache"])
        return output

    _pieces.Decoder.forward = watched  # type: ignore[method-assign]
    try:
        pipe.generate(input_ids=ids, **options(new))
    finally:
        _pieces.Decoder.forward = forward  # type: ignore[method-assign]
    return sum(seen.values())


def median_rounds(ways: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each way's median time over ``rounds`` rounds, each way going first in turn."""
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # a warm-up each
        ways[name]()
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            times[name].append(ways[name]())
    return {name: statistics.median(values) for name, values in times.items()}


# -- one process ---------------------------------------------------------------------------


def one_process(quick: bool, rounds: int, new: int, device: str = "cpu") -> dict[str, Any]:
    from gpipe_transformers import pipeline

    model = build(quick).to(device)
    ids = prompts(model.config.vocab_size).to(device)
    half = len(model.model.layers) // 2
    pipe = pipeline(copy.deepcopy(model), balance=[half, half], chunks=1, devices=[device] * 2)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **options(new))
        whole = model.generate(input_ids=ids, **options(new), return_dict_in_generate=True).cache
    found = pipe.generate(input_ids=ids, **options(new))
    if not torch.equal(found, expected):
        raise AssertionError("pipe.generate's tokens differ from model.generate's")

    def plain() -> float:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, **options(new))
        synchronize()
        return time.perf_counter() - start

    def piped() -> float:
        synchronize()
        start = time.perf_counter()
        pipe.generate(input_ids=ids, **options(new))
        synchronize()
        return time.perf_counter() - start

    medians = median_rounds({"model.generate": plain, "pipe.generate c1": piped}, rounds)
    return {
        "medians": medians, "threads": torch.get_num_threads(),
        "whole_cache": cache_bytes(whole), "pipe_cache": pipeline_cache_bytes(pipe, ids, new),
    }  # fmt: skip


# -- across processes ----------------------------------------------------------------------


def _rank(rank: int, world: int, port: int, shape: tuple[Any, ...], queue: Any) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
        queue.put((rank, "ok", _rank_ways(rank, *shape)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_ways(
    rank: int, quick: bool, rounds: int, new: int, batch: int, lanes: tuple[int, ...]
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.pipeline_parallel import apply_pipeline_parallelism

    from gpipe_transformers import pipeline

    model = build(quick)
    ids = prompts(model.config.vocab_size, batch)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **options(new))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    theirs = apply_pipeline_parallelism(copy.deepcopy(model), mesh)
    pipes = {
        c: pipeline(copy.deepcopy(model), chunks=c, group=dist.group.WORLD, timeout=120)
        for c in lanes
    }
    generators: dict[str, Callable[[], torch.Tensor]] = {
        "hf pp": lambda: theirs.generate(input_ids=ids, **options(new)),
    }
    for c, pipe in pipes.items():
        generators[f"gpipe c{c}"] = lambda pipe=pipe: pipe.generate(input_ids=ids, **options(new))
    checked: dict[str, bool] = {}
    for name, generate in generators.items():
        with torch.no_grad():
            checked[name] = bool(torch.equal(generate(), expected))

    def timed(generate: Callable[[], torch.Tensor]) -> Callable[[], float]:
        def run() -> float:
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                generate()
            dist.barrier()
            return time.perf_counter() - start

        return run

    medians = median_rounds({name: timed(g) for name, g in generators.items()}, rounds)
    caches = {c: pipeline_cache_bytes(pipe, ids, new) for c, pipe in pipes.items()}
    return {"medians": medians, "checked": checked, "caches": caches}


def across_processes(
    quick: bool, rounds: int, new: int, timeout: float, batch: int, lanes: tuple[int, ...]
) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from _step_models import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank,
            args=(rank, 2, port, (quick, rounds, new, batch, lanes), queue),
            daemon=True,
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < 2:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the ranks did not answer within {timeout:g} s")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 5.0))
            except Exception:  # queue.Empty: look for a dead rank
                dead = [p.name for p in processes if not p.is_alive() and p.exitcode]
                if dead:
                    raise RuntimeError(f"ranks died: {dead}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
    return [results[rank] for rank in range(2)]


# -- the bound ----------------------------------------------------------------------------


def decode_step_seconds(model: Any, rows: int, steps: int = 8) -> float:
    """The median time of one decode step of the whole model on ``rows`` sequences (after
    a prefill of the prompts), with one intra-op thread."""
    from transformers import DynamicCache

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = prompts(model.config.vocab_size, rows)
        times = []
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                start = time.perf_counter()
                out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def lane_bounds(quick: bool, batch: int, lanes: tuple[int, ...]) -> dict[int, float]:
    """The most ``c`` lanes can speed two ranks up over ``hf pp``, from the time ``T(r)``
    of a decode step on ``r`` rows (the rows' counts measured interleaved, five times):
    ``hf pp``'s step takes ``T(batch)`` (each rank's half in turn), ``c >= 2`` lanes'
    ``c * T(batch / c) / 2`` (each rank busy with its half of every lane), communication
    free; one lane is ``hf pp``'s order (1.0)."""
    model = build(quick)
    rows = sorted({batch, *(batch // c for c in lanes)})
    seen: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(5):
        for r in rows:
            seen[r].append(decode_step_seconds(model, r))
    step = {r: statistics.median(values) for r, values in seen.items()}
    return {c: 1.0 if c == 1 else 2 * step[batch] / (c * step[batch // c]) for c in lanes}


# -- report --------------------------------------------------------------------------------


class _Skipped(Exception):
    """The ways across processes are not run (``--one-process``)."""


def tokens_per_second(seconds: float, new: int, batch: int = BATCH) -> float:
    return batch * new / seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per way")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the ranks")
    parser.add_argument("--device", default="cpu", help="the one-process ways' device")
    parser.add_argument(
        "--one-process", action="store_true", help="only the one-process ways (a GPU run)"
    )
    args, _ = parser.parse_known_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    new = 8 if args.quick else NEW
    print(f"bench_generate: {BATCH} prompts of {PROMPT} tokens, {new} new tokens, greedy")
    checks: list[tuple[str, bool]] = []
    status = 0
    try:
        alone = one_process(args.quick, rounds, new, args.device)
    except Exception:
        print("one process: FAILED TO RUN\n" + traceback.format_exc())
        status = 1
    else:
        medians = alone["medians"]
        where = f"{alone['threads']} intra-op threads" if args.device == "cpu" else args.device
        print(f"\none process ({where}, 2 partitions), new tokens/s (median):")
        for name, seconds in medians.items():
            print(f"  {name:20s} {tokens_per_second(seconds, new):9.1f}  ({seconds * 1e3:.1f} ms)")
        ratio = medians["model.generate"] / medians["pipe.generate c1"]
        print(f"  pipe / model: {ratio:.2f}x")
        print(
            f"  cache: whole model {alone['whole_cache']:,} bytes; the pipeline's partitions "
            f"together {alone['pipe_cache']:,} bytes"
        )
        checks.append((f"one process: pipe.generate >= 0.9x model.generate ({ratio:.2f}x)",
                       ratio >= 0.9))  # fmt: skip
    for batch, lanes in ((BATCH, GPIPE_LANES), (LARGE_BATCH, LARGE_LANES)):
        if args.one_process:
            break
        if args.quick and batch != BATCH:
            continue
        try:
            ranks = across_processes(args.quick, rounds, new, args.timeout, batch, lanes)
        except Exception:
            print("\nacross 2 processes: FAILED TO RUN\n" + traceback.format_exc())
            status = 1
            continue
        medians = ranks[0]["medians"]
        base = medians["hf pp"]
        print(
            f"\nacross 2 gloo processes (1 intra-op thread each), {batch} prompts, new "
            "tokens/s (median):"
        )
        for name, seconds in medians.items():
            same = all(rank["checked"][name] for rank in ranks)
            print(
                f"  {name:20s} {tokens_per_second(seconds, new, batch):9.1f}  "
                f"({seconds * 1e3:.1f} ms)  {base / seconds:.2f}x hf pp  "
                f"tokens {'equal' if same else 'DIFFER'}"
            )
            if not same:
                status = 1
        bounds = lane_bounds(args.quick, batch, lanes)
        shown = ", ".join(f"c{c}: {bound:.2f}x" for c, bound in bounds.items())
        print(f"  bound over hf pp, from a decode step's time on a lane's rows: {shown}")
        for rank, found in enumerate(ranks):
            shown = ", ".join(f"c{c}: {b:,}" for c, b in found["caches"].items())
            print(f"  rank {rank} cache bytes at the end ({shown})")
        if batch == BATCH:
            c2, c1 = base / medians["gpipe c2"], base / medians["gpipe c1"]
            checks.append((f"2 ranks: gpipe c2 >= 1.6x hf pp ({c2:.2f}x)", c2 >= 1.6))
            checks.append((f"2 ranks: gpipe c1 >= 1.0x hf pp ({c1:.2f}x)", c1 >= 1.0))
    print()
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'} {text}")
    return status


if __name__ == "__main__":
    sys.exit(main())
