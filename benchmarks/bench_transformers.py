"""A Hugging Face causal LM through ``gpipe.transformers.pipeline()``: what the bridge costs.

Run it as a script (``python benchmarks/bench_transformers.py``, ``--quick`` for a short
run with a smaller model), or with ``nox -s bench``. The model is a Llama-style causal LM
built from ``LlamaConfig`` with random weights (8 decoder layers, hidden size 256, MLP 704,
4 heads, vocabulary 8192, untied embeddings, sdpa attention), trained on a batch of 16
sequences of 128 tokens, float32, on the CPU with one intra-op thread per process
(``--threads``). One training step (forward, the model's next-token loss and backward of
the whole batch) is timed these ways, interleaved round by round (each way goes first in
turn) so that the machine's load affects them alike:

In one process, 2 partitions (4 decoder layers each), 4 micro-batches:

- ``plain``: the model itself, ``model(input_ids=..., labels=...).loss.backward()``;
- ``step gpipe`` and ``step 1f1b``: ``pipeline(model, balance=[4, 4], chunks=4)``'s
  ``step(input_ids=..., labels=..., schedule=...)``, each schedule;
- ``hand gpipe`` and ``hand 1f1b``: the same split written by hand as an ``nn.Sequential``
  (a ``PipeSequential`` of an embedding layer that computes the rotary position
  embeddings, one layer per decoder layer calling it with them, a head layer with the
  final norm and ``lm_head``: the same Hugging Face submodules) in a ``GPipe`` with the
  same balance, checkpointing, schedule and loss (a ``BatchMean`` of the shifted token
  cross entropy).

Across 2 gloo processes (one partition each, 4 micro-batches), in the same processes:

- ``dist gpipe`` and ``dist 1f1b``: ``pipeline(model, chunks=4, checkpoint="never",
  group=WORLD).step(...)`` called on every rank with the same inputs (no checkpointing,
  as pipelining has none);
- ``pipe gpipe`` and ``pipe 1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe``
  and ``Schedule1F1B`` on one ``PipelineStage`` per rank, each stage written by hand the
  way torchtitan writes its stages: a deep copy of the model with the other stage's
  modules deleted (the embedding on the first, the norm and the head on the last), its
  decoder layers kept in a ``ModuleDict`` under their indices, and a ``forward`` that skips
  what was deleted. Its loss is the same token cross entropy, per micro-batch.

Before the timing, the three one-process ways' losses are compared once (they must agree).
Times are medians over the timed steps, after two warm-up steps per way. The targets are
printed at the end as PASS or FAIL lines: ``pipeline()`` at most 3% over the hand-written
sequence (``step / hand``), and across processes at most ``torch.distributed.pipelining``
(``dist / pipe``), each schedule. A FAIL does not change the exit status (a loaded machine
can fail a timing), but a way that fails to run makes the script exit 1 after printing what
it measured. Every wait for another process is bounded, and every process is ended and
reaped, also on failure. Only ratios within one run are meaningful.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _step_models import (
    PIPELINING_SCHEDULES,
    Check,
    Ranks,
    RankStep,
    Ways,
    bench_parser,
    failed,
    finish,
    measure,
    ms,
    parallel_speedup,
    parse_bench,
    parse_way,
    pipelining_check,
    print_table,
    print_unrun,
    timed,
)

SCHEDULES = ("gpipe", "1f1b")
LOCAL_WAYS = ("plain", "step gpipe", "step 1f1b", "hand gpipe", "hand 1f1b")
RANK_WAYS = ("dist gpipe", "dist 1f1b", "pipe gpipe", "pipe 1f1b")
#: Seconds any wait for a rank may last (a step, the start of the processes).
TIMEOUT = 300.0


@dataclass(frozen=True)
class Setup:
    """The model and the batch, built alike in every process from the seed."""

    layers: int = 8
    hidden: int = 256
    intermediate: int = 704
    heads: int = 4
    vocab: int = 8192
    batch: int = 16
    seq: int = 128
    chunks: int = 4
    partitions: int = 2
    seed: int = 0

    @staticmethod
    def of(quick: bool) -> Setup:
        if quick:
            return Setup(layers=4, hidden=32, intermediate=64, heads=2, vocab=256, batch=8, seq=16)
        return Setup()

    def describe(self) -> str:
        return (
            f"Llama-style, {self.layers} decoder layers, hidden {self.hidden}, MLP "
            f"{self.intermediate}, {self.heads} heads, vocabulary {self.vocab}, batch "
            f"{self.batch} x {self.seq} tokens, float32, P{self.partitions} M{self.chunks}, "
            "sdpa attention; in one process the default checkpointing (except_last), across "
            "processes none"
        )

    def model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=max(self.seq, 128),
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        torch.manual_seed(self.seed)
        return LlamaForCausalLM(config)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids and the labels (the ids themselves, as causal LM training has)."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        ids = torch.randint(self.vocab, (self.batch, self.seq), generator=generator)
        return ids, ids.clone()

    def balance(self) -> list[int]:
        """Decoder layers per partition (pipeline()'s balance)."""
        share, extra = divmod(self.layers, self.partitions)
        return [share + (k < extra) for k in range(self.partitions)]


# --------------------------------------------------------------------------------------------
# The loss: the model's next-token cross entropy
# --------------------------------------------------------------------------------------------


def token_total(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross entropy (-100 ignored)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss of one micro-batch (pipelining's loss function)."""
    return token_total(logits, labels) / token_count(labels).clamp(min=1)


# --------------------------------------------------------------------------------------------
# The split written by hand as an nn.Sequential (same Hugging Face submodules)
# --------------------------------------------------------------------------------------------


def _rotary(rotary: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    cos, sin = rotary(hidden, positions)
    return cos, sin


def _decode(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    # No mask: sdpa attention is causal when it is given none (no padding here).
    out = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out


class HandEmbed(nn.Module):
    """The token embedding, and the rotary position embeddings every layer needs."""

    def __init__(self, embed: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.embed, self.rotary = embed, rotary

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.embed(ids)
        return (hidden, *_rotary(self.rotary, hidden))


class HandDecoder(nn.Module):
    """One decoder layer, given the rotary position embeddings (passed on)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _decode(self.layer, hidden, cos, sin), cos, sin


class HandHead(nn.Module):
    """The final norm and the head: the logits."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def hand_sequence(model: nn.Module) -> nn.Sequential:
    """The model as a sequence whose layers pass tuples on as positional arguments."""
    from gpipe_core import PipeSequential

    base = model.model
    return PipeSequential(
        HandEmbed(base.embed_tokens, base.rotary_emb),
        *(HandDecoder(layer) for layer in base.layers),
        HandHead(base.norm, model.lm_head),
    )


# --------------------------------------------------------------------------------------------
# The split the way torchtitan writes it, for torch.distributed.pipelining
# --------------------------------------------------------------------------------------------


class TitanStage(nn.Module):
    """One stage as torchtitan writes it: a deep copy of the whole model whose other stages'
    modules are deleted; the decoder layers it keeps are a ``ModuleDict`` under their
    indices, and its ``forward`` skips what was deleted (the embedding, the norm, the head)."""

    def __init__(self, model: nn.Module, keep: range, first: bool, last: bool) -> None:
        super().__init__()
        whole = copy.deepcopy(model)
        base = whole.model
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(k): base.layers[k] for k in keep})
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = whole.lm_head if last else None
        del whole, base  # the modules not kept go with the copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        cos, sin = _rotary(self.rotary_emb, hidden)
        for layer in self.layers.values():
            hidden = _decode(layer, hidden, cos, sin)
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.lm_head(hidden) if self.lm_head is not None else hidden


# --------------------------------------------------------------------------------------------
# The ways
# --------------------------------------------------------------------------------------------


def local_runners(setup: Setup) -> tuple[dict[str, Any], dict[str, float]]:
    """The one-process ways' runners, and each way's loss of one step (to compare)."""
    from gpipe_core import BatchMean, GPipe
    from gpipe_transformers import pipeline

    ids, labels = setup.data()
    runners: dict[str, Any] = {}
    losses: dict[str, float] = {}

    plain = setup.model()
    runners["plain"] = timed(plain, lambda: plain(input_ids=ids, labels=labels).loss.backward())
    with torch.no_grad():
        losses["plain"] = float(plain(input_ids=ids, labels=labels).loss)

    balance = setup.balance()
    for schedule in SCHEDULES:
        try:
            pipe = pipeline(setup.model(), balance=balance, chunks=setup.chunks)
            losses[f"step {schedule}"] = float(
                pipe.step(input_ids=ids, labels=labels, schedule=schedule).reduced()
            )
            runners[f"step {schedule}"] = timed(
                pipe,
                lambda pipe=pipe, schedule=schedule: pipe.step(
                    input_ids=ids, labels=labels, schedule=schedule
                ),
            )
        except Exception as error:
            runners[f"step {schedule}"] = failed(error)
        try:
            hand_balance = [balance[0] + 1, *balance[1:-1], balance[-1] + 1]
            hand = GPipe(hand_sequence(setup.model()), hand_balance, chunks=setup.chunks)
            loss_fn = BatchMean(token_total, token_count)
            losses[f"hand {schedule}"] = float(
                hand.step(ids, labels, loss_fn, schedule=schedule).reduced()
            )
            runners[f"hand {schedule}"] = timed(
                hand,
                lambda hand=hand, schedule=schedule, loss_fn=loss_fn: hand.step(
                    ids, labels, loss_fn, schedule=schedule
                ),
            )
        except Exception as error:
            runners[f"hand {schedule}"] = failed(error)
    return {way: runners[way] for way in LOCAL_WAYS}, losses


def rank_steps(
    rank: int, world: int, setup: Setup, ways: Sequence[str], timeout: float
) -> tuple[dict[str, RankStep], dict[str, str]]:
    """This rank's step of each of ``ways`` (``dist``: pipeline() with ``group=``; ``pipe``:
    pipelining on torchtitan-style stages), and why each way not built was not."""
    steps: dict[str, RankStep] = {}
    unbuilt: dict[str, str] = {}
    for name in ways:
        way = parse_way(name)
        try:
            if way.kind == "dist":
                steps[name] = _dist_step(setup, way.schedule, timeout)
            else:
                steps[name] = _pipe_step(rank, world, setup, way.schedule)
        except Exception as error:
            unbuilt[name] = failed(error)
    return steps, unbuilt


def _dist_step(setup: Setup, schedule: str, timeout: float) -> RankStep:
    import torch.distributed as dist

    from gpipe_transformers import pipeline

    ids, labels = setup.data()
    # No checkpointing, as pipelining has none.
    pipe = pipeline(
        setup.model(),
        chunks=setup.chunks,
        checkpoint="never",
        group=dist.group.WORLD,
        timeout=timeout,
    )
    return pipe, lambda: pipe.step(input_ids=ids, labels=labels, schedule=schedule)


def _pipe_step(rank: int, world: int, setup: Setup, schedule: str) -> RankStep:
    from torch.distributed import pipelining

    ids, labels = setup.data()
    model = setup.model()
    bounds = [0]
    for count in setup.balance():
        bounds.append(bounds[-1] + count)
    first, last = rank == 0, rank == world - 1
    stage_module = TitanStage(model, range(bounds[rank], bounds[rank + 1]), first, last)
    micro = ids.tensor_split(setup.chunks)[0]
    if first:
        example: torch.Tensor = micro
    else:
        with torch.no_grad():  # the hidden states this stage receives
            example = model.model.embed_tokens(micro)
    stage = pipelining.PipelineStage(
        stage_module, rank, world, torch.device("cpu"), input_args=(example.detach(),)
    )
    schedule_class = getattr(pipelining, PIPELINING_SCHEDULES[schedule])
    runner = schedule_class(stage, n_microbatches=setup.chunks, loss_fn=token_mean)

    def run() -> None:
        if first:
            runner.step(ids)
        elif last:
            runner.step(target=labels, losses=[])
        else:
            runner.step()

    return stage_module, run


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    args, rounds, _, _ = parse_bench(parser, argv)
    torch.set_num_threads(args.threads)
    setup = Setup.of(args.quick)
    try:
        import transformers
    except ImportError as error:
        print(f"bench_transformers: transformers is not installed ({error}); nothing to run")
        return 0

    print(
        f"A Hugging Face causal LM through pipeline(): CPU, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, intra-op threads {torch.get_num_threads()} "
        f"per process, {os.cpu_count()} cores, {rounds} rounds (medians), ways interleaved"
    )
    print(f"  {setup.describe()}")
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"  load average {load}; two threads run {parallel_speedup():.2f}x as fast as one on "
        "independent matmuls (2.00 on two idle cores; less when other processes use them)"
    )
    print()

    runners, losses = local_runners(setup)
    spread = max(losses.values()) - min(losses.values()) if losses else float("nan")
    print(
        "One step's loss, each way: "
        + ", ".join(f"{way} {value:.6f}" for way, value in losses.items())
        + f" (largest difference {spread:.1e})"
    )
    results: dict[str, Any] = measure(runners, rounds)
    print("  measured one process", file=sys.stderr, flush=True)

    ways = Ways(args.threads, TIMEOUT)
    remote: list[str] = list(RANK_WAYS)
    reason = pipelining_check()
    if reason is not None:
        results.update(dict.fromkeys([w for w in remote if w.startswith("pipe ")], reason))
        remote = [w for w in remote if not w.startswith("pipe ")]
    try:
        group = Ranks(
            setup, remote, args.threads, TIMEOUT, world=setup.partitions, build=rank_steps
        )
    except Exception as error:
        results.update(dict.fromkeys(remote, failed(error)))
    else:
        ways.groups.append(("processes", group))
        rank_runners: dict[str, Any] = {
            way: group.unbuilt.get(way) or (lambda way=way: group.step(way)) for way in remote
        }
        try:
            results.update(measure(rank_runners, rounds))
        finally:
            ways.close()
        print("  measured across processes", file=sys.stderr, flush=True)

    # Tables ----------------------------------------------------------------------------------
    print()
    print("Step time, ms (medians)")
    print_table(
        ["way", "ms"],
        [[way, ms(value) if isinstance(value, float) else "-"] for way, value in results.items()],
    )
    print()

    def ratio(a: str, b: str) -> float | None:
        x, y = results.get(a), results.get(b)
        return x / y if isinstance(x, float) and isinstance(y, float) else None

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print("Relative step times (lower is better)")
    rows = []
    for schedule in SCHEDULES:
        rows.append(
            [
                schedule,
                show(ratio(f"step {schedule}", "plain")),
                show(ratio(f"hand {schedule}", "plain")),
                show(ratio(f"step {schedule}", f"hand {schedule}")),
                show(ratio(f"dist {schedule}", f"pipe {schedule}")),
            ]
        )
    print_table(["schedule", "step/plain", "hand/plain", "step/hand", "dist/pipe"], rows)
    print()

    problems = {way: value for way, value in results.items() if isinstance(value, str)}
    print_unrun(problems)

    # Targets ---------------------------------------------------------------------------------
    checks: list[Check] = [
        ("one process: the ways' losses agree within 1e-4", spread if losses else None, 1e-4)
    ]
    for schedule in SCHEDULES:
        checks.append(
            (
                f"one process: pipeline() {schedule} / hand-written {schedule} <= 1.03",
                ratio(f"step {schedule}", f"hand {schedule}"),
                1.03,
            )
        )
    for schedule in SCHEDULES:
        checks.append(
            (
                f"2 processes: pipeline() {schedule} / pipelining {schedule} <= 1.00",
                ratio(f"dist {schedule}", f"pipe {schedule}"),
                1.00,
            )
        )
    return finish(checks, problems, ways)


if __name__ == "__main__":
    sys.exit(main())
