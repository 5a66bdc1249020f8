"""The router's auxiliary loss of a mixture-of-experts causal LM, as the model computes it
(``output_router_logits=True``): the load-balancing loss over every layer and the whole
mini-batch, padding excluded by the attention mask.

The loss is ``E * sum_e C[e] * S[e] / W**2``: ``C[e]``, the number of times expert ``e``
is among a token's ``top_k`` (no gradient), ``S[e]``, the sum of its router probability,
each over every router call (layer) and every token the attention mask keeps, and ``W``,
the number of those tokens times the router calls. It is the product of two sums over the
mini-batch, so a micro-batch alone does not give it; but it is linear in ``S`` with ``C``
and ``W`` fixed, so each micro-batch's share of the gradient is that of
``coefficient * E * sum_e C[e] * S_mb[e] / W**2``, once ``C`` and ``W`` are known. A
:class:`Tally` gathers them in a step, across partitions and ranks, before the first
backward pass; the step's schedule must therefore end every forward pass before its first
backward pass (``"gpipe"``).

Which modules are the routers and which of their outputs are the logits is the model's
own declaration (transformers' ``_can_record_outputs["router_logits"]``); whether the loss is
the model's is checked on a probe before anything runs. It must not know how a step runs:
the pipeline begins and ends a step's tally and gives each piece its tally.
"""

from __future__ import annotations

import datetime
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipeSchedule, Losses

from ._layout import WRITE_IT, LayoutError, evaluating, probe_inputs

__all__ = [
    "CHUNKS",
    "MASK",
    "Router",
    "RouterLosses",
    "Tally",
    "asked_tally",
    "chunk_count",
    "find_router",
    "routed_step",
]

# The carry's keys: each micro-batch's attention mask (the tokens the loss counts) and the
# number of micro-batches of the step, from the embeddings to every decoder layer.
MASK = "router_mask"
CHUNKS = "router_chunks"


@dataclass(frozen=True)
class Router:
    """What a model's router loss is read from: each decoder layer's routers (transformers'
    recorder of ``router_logits``: a module class or name, and which output is the
    logits), the number of experts a token is routed to, and the loss's coefficient."""

    specs: tuple[Any, ...]
    experts: int
    top_k: int
    coefficient: float

    def routers(
        self, layers_path: str, layer: nn.Module, index: int
    ) -> list[tuple[nn.Module, int]]:
        """The routers of decoder layer ``index`` (``layer``), each with the position of
        the logits in its output, as transformers' recorder matches them (by class, or by
        the end of the name, and by ``layer_name``)."""
        found = []
        prefix = f".{layers_path}.{index}"
        for name, module in layer.named_modules(prefix=prefix):
            for spec in self.specs:
                target, suffix = spec.target_class, spec.class_name
                match = (target is not None and isinstance(module, target)) or (
                    suffix is not None and name.endswith(suffix)
                )
                if match and spec.layer_name is not None:
                    match = f".{spec.layer_name.strip('.')}." in f"{name}."
                if match:
                    found.append((module, spec.index))
                    break
        return found


def find_router(model: nn.Module, layers_path: str, name: str) -> Router | LayoutError | None:
    """The router loss of ``model`` (None: the model records no router logits), checked to
    be the model's own before anything runs; or why gpipe cannot compute it (the
    model's loss adds other router terms, or it names no number of experts per token or
    coefficient), raised where the router loss is asked for."""
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    specs: Any = None
    path = ""
    for part in ("", *layers_path.split(".")):
        path = f"{path}.{part}".strip(".") if part else path
        module = model.get_submodule(path)
        if isinstance(module, PreTrainedModel):
            specs = _CAN_RECORD_REGISTRY.get(module).get("router_logits", specs)
    if specs is None:
        return None
    specs = tuple(specs) if isinstance(specs, list) else (specs,)
    config = model.config
    texts = (model, config, getattr(config, "text_config", None))
    top_k = _first(texts, ("num_experts_per_tok", "top_k", "moe_topk"))
    coefficient = _first(texts, ("router_aux_loss_coef", "aux_loss_coef"))
    if not isinstance(top_k, int) or not isinstance(coefficient, (int, float)):
        return LayoutError(
            f"{name} records its router logits but names no number of experts per token "
            f"(num_experts_per_tok: {top_k!r}) or auxiliary loss coefficient "
            f"(router_aux_loss_coef: {coefficient!r}): set config.output_router_logits = "
            f"False to train to the labels loss alone (model: {name})"
        )
    router = Router(specs, 0, top_k, float(coefficient))
    experts = _experts(model, router, layers_path)
    router = Router(specs, experts, top_k, float(coefficient))
    refusal = _check(model, router, name)
    return router if refusal is None else refusal


def _experts(model: nn.Module, router: Router, layers_path: str) -> int:
    """The number of experts: the rows of the first router's weight, or the config's."""
    layers = model.get_submodule(layers_path)
    assert isinstance(layers, nn.ModuleList)
    for index, layer in enumerate(layers):
        for module, _ in router.routers(layers_path, layer, index):
            weight = getattr(module, "weight", None)
            if isinstance(weight, Tensor) and weight.dim() == 2:
                return int(weight.shape[0])
    config = model.config
    texts = (model, config, getattr(config, "text_config", None))
    experts = _first(texts, ("num_experts", "num_local_experts", "n_routed_experts"))
    return int(experts) if isinstance(experts, int) else 0


def _first(sources: tuple[Any, ...], names: tuple[str, ...]) -> Any:
    for source in sources:
        for attribute in names:
            value = getattr(source, attribute, None)
            if value is not None:
                return value
    return None


def statistics(logits: Tensor, mask: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """One router call's ``(C, S, W)`` over the tokens ``mask`` keeps: each expert's
    count among the tokens' ``top_k`` (detached), the sum of each expert's probability
    (differentiable) and the number of tokens, as the model's load-balancing loss counts
    them."""
    probabilities = F.softmax(logits, dim=-1)
    _, chosen = torch.topk(probabilities, top_k, dim=-1)
    kept = mask.reshape(-1).to(probabilities.dtype)
    counts = torch.zeros(logits.shape[-1], dtype=kept.dtype, device=kept.device)
    counts.scatter_add_(0, chosen.reshape(-1), kept.repeat_interleave(top_k))
    sums = (probabilities * kept.unsqueeze(-1)).sum(dim=0)
    return counts, sums, kept.sum()


def auxiliary(counts: Tensor, sums: Tensor, rows: Tensor) -> Tensor:
    """The load-balancing loss of the summed statistics: ``E * sum(C * S) / W**2``."""
    return counts.shape[-1] * (counts * sums).sum() / rows**2


def _check(model: nn.Module, router: Router, name: str) -> LayoutError | None:
    """Refuse a model whose loss is not its labels loss plus ``coefficient`` times the
    load-balancing loss of :func:`statistics`, on the probe (a padded one) in eval mode; a
    model on the meta device (from_pretrained's, before its layers are read) is checked
    on its family's ``load_balancing_loss_func``, on logits drawn here."""
    meta = any(p.device.type == "meta" for p in model.parameters())
    try:
        if meta:
            seen, ours = _family_function(model, router)
        else:
            seen, ours = _probe_loss(model, router)
        same = abs(seen - ours) <= 1e-5 * max(1.0, abs(ours))
    except Exception as error:
        return LayoutError(
            f"{name}'s router loss could not be checked against gpipe's "
            f"({type(error).__name__}: {error}): set config.output_router_logits = False to "
            f"train to the labels loss alone, or {WRITE_IT} (model: {name})"
        )
    if not same:
        return LayoutError(
            f"{name}'s loss with output_router_logits=True is not its labels loss plus "
            f"{router.coefficient} times the load-balancing loss of its routers' top "
            f"{router.top_k} (on the probe: {seen!r} where gpipe computes {ours!r}): its "
            "loss adds router terms gpipe does not compute; set "
            f"config.output_router_logits = False to train to the labels loss alone "
            f"(model: {name})"
        )
    return None


def _probe_loss(model: nn.Module, router: Router) -> tuple[float, float]:
    """The model's loss on the padded probe, and gpipe's from the model's logits."""
    ids = probe_inputs(model)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # padding, which the router loss leaves out
    with evaluating(model):
        out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    logits = out.logits.double()[:, :-1].flatten(0, 1)
    labels = F.cross_entropy(logits, ids[:, 1:].flatten()).item()
    aux = _aux_of([layer.double() for layer in out.router_logits], mask, router.top_k)
    return float(out.loss), labels + router.coefficient * aux


def _family_function(model: nn.Module, router: Router) -> tuple[float, float]:
    """The family's ``load_balancing_loss_func`` on router logits drawn here, and gpipe's."""
    function = sys.modules[type(model).__module__].load_balancing_loss_func
    generator = torch.Generator().manual_seed(0)
    experts = router.experts
    logits = tuple(torch.randn(6, experts, generator=generator, dtype=torch.float64) for _ in "ab")
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    seen = float(function(logits, experts, router.top_k, mask))
    return seen, _aux_of(list(logits), mask, router.top_k)


def _aux_of(logits: list[Tensor], mask: Tensor, top_k: int) -> float:
    """The load-balancing loss of a mini-batch's router logits, one tensor per call."""
    if not logits:
        raise ValueError("the model's routers gave no logits")
    rows = [
        torch.cat([c, s, w.reshape(1)]) for c, s, w in (statistics(x, mask, top_k) for x in logits)
    ]
    total = torch.stack(rows).sum(0)
    experts = logits[0].shape[-1]
    return auxiliary(total[:experts], total[experts:-1], total[-1]).item()


class _Term(torch.autograd.Function):
    """Zero in the forward pass, added to a layer's hidden states; in their backward pass,
    the gradient of the router loss with respect to a router call's probability sums: the
    tally's scale."""

    @staticmethod
    def forward(ctx: Any, sums: Tensor, tally: Tally) -> Tensor:
        ctx.tally, ctx.like = tally, sums.new_empty(0)
        return sums.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # The term is added to the layer's hidden states, so it is reached in their
        # backward pass; what reaches it is theirs, not its own, and is not used.
        like = ctx.like
        return ctx.tally.scale().to(device=like.device, dtype=like.dtype), None


class Tally:
    """The router statistics of one step on this process (every local partition's), and
    their sums over the pipeline's ranks (``group``) and its data-parallel ranks (its
    ``data_group``, or its mesh's data-parallel dimensions: ``data_groups``), each of which
    passes its own share of the mini-batch.

    A step :meth:`begin` s it with how many decoder layers this process holds; each
    decoder layer's forward pass :meth:`collecting` s its routers' logits and
    :meth:`add` s their statistics. Once this process has run every micro-batch through its
    layers (the carry says how many there are), it starts the sum over the ranks; the first
    backward pass waits for it (:meth:`scale`), and :meth:`end` gives the step's router
    loss.
    """

    def __init__(
        self,
        router: Router,
        layers_path: str,
        group: dist.ProcessGroup | None,
        data_groups: Sequence[dist.ProcessGroup],
        timeout: float | None,
    ) -> None:
        self.router, self.layers_path = router, layers_path
        self.group, self.data_groups, self.timeout = group, tuple(data_groups), timeout
        self.active = False
        self.chunks = 0
        self._lock = threading.Lock()
        self._reset(0)

    def _reset(self, layers: int) -> None:
        self._layers = layers
        self._calls = 0
        # C, S and W summed over this process's router calls.
        self._sums = torch.zeros(2 * self.router.experts + 1, dtype=torch.float64)
        self._work: Any = None
        self._total: Tensor | None = None

    def begin(self, layers: int, chunks: int) -> None:
        """Start a step on a process that holds ``layers`` decoder layers, of ``chunks``
        micro-batches (where this process holds the embeddings, which tell the others)."""
        self._reset(layers)
        self.chunks = chunks
        self.active = True
        if layers == 0:
            self._start(failed=False)

    @contextmanager
    def collecting(self, layer: nn.Module, index: int) -> Iterator[list[Tensor]]:
        """The router logits of decoder layer ``index`` (``layer``) in the forward pass
        inside, in order."""
        logits: list[Tensor] = []
        routers = self.router.routers(self.layers_path, layer, index)

        def record(module: nn.Module, args: object, output: Any) -> None:
            logits.append(output if isinstance(output, Tensor) else output[index_of[module]])

        index_of = dict(routers)
        handles = [module.register_forward_hook(record) for module, _ in routers]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    def add(self, hidden: Tensor, logits: list[Tensor], mask: object, chunks: object) -> Tensor:
        """``hidden`` with the router loss's gradient of ``logits`` (a micro-batch's, whose
        attention mask is ``mask``) attached; counted once (not again when recomputed)."""
        if not self.active:
            return hidden
        assert isinstance(mask, Tensor) and isinstance(chunks, Tensor), "the carry's"
        term = None
        recount = is_recomputing()
        stats = []
        for layer in logits:
            flat = layer.reshape(-1, layer.shape[-1])
            if flat.shape[0] != mask.numel():
                raise RuntimeError(
                    f"a router gave logits for {flat.shape[0]} tokens where the micro-batch "
                    f"has {mask.numel()} ({tuple(mask.shape)}): the router loss cannot be "
                    "counted; set output_router_logits=False"
                )
            counts, sums, rows = statistics(flat, mask.to(flat.device), self.router.top_k)
            stats.append(torch.cat([counts, sums.detach(), rows.reshape(1)]))
            if torch.is_grad_enabled() and sums.requires_grad:
                piece = cast(Tensor, _Term.apply(sums, self))  # type: ignore[no-untyped-call]
                term = piece if term is None else term + piece
        if not recount:
            self._count(stats, int(chunks))
        return hidden if term is None else hidden + term.to(hidden.dtype)

    def _count(self, stats: list[Tensor], chunks: int) -> None:
        with self._lock:
            for row in stats:
                self._sums += row.to("cpu", torch.float64)
            self._calls += 1
            done = self._calls == chunks * self._layers
        if done:
            self._start(failed=False)

    def _start(self, failed: bool) -> None:
        """Start the sum over the ranks (in one process: keep this process's)."""
        flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64)
        self._sums = torch.cat([self._sums, flag])
        if self.group is not None:
            self._work = dist.all_reduce(self._sums, group=self.group, async_op=True)
        else:
            self._work = True

    def _summed(self) -> Tensor:
        with self._lock:
            if self._total is not None:
                return self._total
            if self._work is None:
                raise RuntimeError(
                    "a backward pass began before every micro-batch's forward pass ended: the "
                    "router loss needs all of them first; use schedule='gpipe'"
                )
            total = self._sums
            if self.group is not None:
                self._wait(self._work, "the pipeline's ranks")
            for data_group in self.data_groups:
                work = dist.all_reduce(total, group=data_group, async_op=True)
                self._wait(work, "the data-parallel ranks")
            if total[-1].item():
                raise RuntimeError("another rank failed before it counted its routers")
            self._total = total
            return total

    def _wait(self, work: Any, who: str) -> None:
        """Wait for the sum ``work`` at most the pipeline's timeout."""
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise TimeoutError(
                f"{who} did not all count their routers within {self.timeout} s, or one is "
                f"gone ({error})"
            ) from error

    def scale(self) -> Tensor:
        """The gradient of the step's router loss with respect to each expert's summed
        probability: ``coefficient * E * C / W**2`` (times the replicas, whose gradients
        are averaged)."""
        total = self._summed()
        counts, rows = total[: self.router.experts], total[-2]
        replicas = math.prod(data_group.size() for data_group in self.data_groups)
        return self.router.coefficient * self.router.experts * replicas * counts / rows**2

    def end(self, failed: bool) -> Tensor | None:
        """End the step: its router loss (None where it failed), the sums of every rank
        waited for (a process that failed takes part too, saying so).

        Raises:
            RuntimeError: the step ran without counting every micro-batch's routers.
        """
        self.active = False
        incomplete = self._work is None
        if incomplete:
            self._start(failed=True)
        if failed or incomplete:
            with suppress(Exception):  # the step's own error is raised
                self._summed()
            if incomplete and not failed:
                raise RuntimeError(
                    f"the step counted the routers of {self._calls} decoder layer calls of "
                    f"the {self.chunks * self._layers} its micro-batches make: the router "
                    "loss is not known"
                )
            return None
        total = self._summed()
        experts = self.router.experts
        return auxiliary(total[:experts], total[experts : 2 * experts], total[-2])


def asked_tally(
    tally: Tally | LayoutError | None, keywords: dict[str, Any], model: nn.Module
) -> Tally | None:
    """The tally of a step that trains to the router loss too (the call's
    ``output_router_logits``, or the config's), or None; refused, naming what to do,
    where it cannot be exact."""
    asked = keywords.pop("output_router_logits", None)
    name = type(model).__name__
    if asked is None:
        asked = bool(getattr(model.config, "output_router_logits", False))
    if not asked:
        return None
    if isinstance(tally, LayoutError):
        raise tally
    if tally is None:
        raise ValueError(
            f"output_router_logits=True asks for the router loss, but {name} records no "
            "router logits (it has no mixture-of-experts routers) "
            f"(output_router_logits: {asked!r})"
        )
    schedule = keywords.get("schedule", "gpipe")
    if not (schedule == "gpipe" or isinstance(schedule, GPipeSchedule)):
        shown_schedule = schedule if isinstance(schedule, str) else type(schedule).__name__
        raise ValueError(
            f"schedule={shown_schedule!r} starts a backward pass before the last "
            "micro-batch's forward pass ends, and the router loss "
            "(output_router_logits=True) needs every micro-batch's expert counts "
            "first: use schedule='gpipe', or output_router_logits=False "
            f"(schedule: {shown_schedule!r})"
        )
    mask = keywords.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() != 2:
        raise ValueError(
            "the router loss counts the tokens of a 2-dimensional attention mask "
            "(batch, positions), as the model's does: pass that mask "
            f"(attention_mask: shape {tuple(mask.shape)})"
        )
    return tally


class RouterLosses(Losses):
    """The losses of a step that trains to the router loss too: each micro-batch's labels
    loss, as :class:`~gpipe_core.Losses`, and the mini-batch's router loss
    (:attr:`aux_loss`, the model's ``aux_loss``); :meth:`reduced` is the model's ``loss``,
    the labels loss plus ``coefficient`` times the router loss."""

    def __init__(self, losses: Losses, aux_loss: Tensor, coefficient: float) -> None:
        super().__init__(list(losses), losses.sizes, losses.reduction, losses.counts)
        like = losses[0] if len(losses) else aux_loss
        #: The mini-batch's load-balancing loss, over every layer and rank (in the
        #: losses' dtype, on their device).
        self.aux_loss = aux_loss.to(like.device, like.dtype)
        #: What the router loss is multiplied by in the model's loss.
        self.coefficient = coefficient

    def reduced(self) -> Tensor:
        labels = super().reduced()
        return labels + self.coefficient * self.aux_loss


def chunk_count(batch: object, chunks: int) -> int:
    """How many micro-batches gpipe splits ``batch`` (a tensor, or None where this process
    does not hold the inputs) into: as :func:`torch.chunk` does."""
    if not isinstance(batch, Tensor) or batch.dim() == 0:
        return 0
    size = batch.shape[0]
    return 1 if size <= 1 or chunks == 1 else len(torch.empty(size, 0).chunk(chunks))


def routed_step(
    tally: Tally, step: Callable[[], Losses | None], layers: int, chunks: int
) -> Losses | None:
    """Run ``step`` with ``tally`` counting the routers of this process's ``layers``
    decoder layers; the losses with the router loss where ``step`` gives them."""
    tally.begin(layers, chunks)
    try:
        losses = step()
    except BaseException:
        tally.end(failed=True)
        raise
    aux = tally.end(failed=False)
    if losses is None or aux is None:
        return losses
    return RouterLosses(losses, aux, tally.router.coefficient)
