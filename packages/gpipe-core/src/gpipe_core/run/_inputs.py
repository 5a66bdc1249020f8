"""A run's inputs, parsed, checked and split: what :meth:`GPipe.forward
<gpipe_core.GPipe.forward>` and :meth:`GPipe.step <gpipe_core.GPipe.step>` are called
with, as one value (:class:`RunInputs`): the micro-batches of the input and their sizes, the
first layer's calling convention, the input and target cut from the caller's graph
(:class:`Leaves`), and on the last partition the loss spec (the target's micro-batches on its
device, each micro-batch's scale for the reduction); at the end of a step, the
:class:`~gpipe_core.Losses` (the step of an empty pipeline too: the losses of the input
itself).

This module owns every check of the arguments of a run, made before anything changes. It
must not know partitions, schedules' orders or transports: the micro-batches' sizes reach
the other ranks through the ``share`` it is given, and where the first and last partitions
run it is told.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gpipe_checkpoint import is_checkpointing, is_recomputing
from gpipe_microbatch import Batch, NoChunk, scatter, values_of, with_values
from gpipe_microbatch import labels as microbatch_labels

from ..schedule._schedules import GPipeSchedule, Schedule, get_schedule
from ..transport._agreement import Fields, run_fields
from ..transport._transport import Plan
from ._losses import BatchMean, Losses, LossFunction, LossSpec, Reduction

__all__ = [
    "UNSET",
    "CountMean",
    "Leaves",
    "RunInputs",
    "Share",
    "batch_sizes",
    "check_input_device",
    "check_loss_denominator",
    "check_reduction",
    "first_call",
    "forward_inputs",
    "positional",
    "step_inputs",
    "tensor_of",
    "to_device",
]

#: Gives the run's plan (the micro-batches' sizes) from the first partition's rank to every
#: rank, with the run's fields to agree on (see :func:`~gpipe_core.transport._session.share_plan`).
Share = Callable[[Plan | None, Fields], Plan]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return batch.with_tensors(tensor.to(device) for tensor in batch)


def tensor_of(item: object) -> torch.Tensor | None:
    """The tensor an element of a mini-batch passes to the layers (NoChunk unwrapped)."""
    if isinstance(item, NoChunk):
        return item.tensor
    return item if isinstance(item, torch.Tensor) else None


def batch_sizes(value: object, batches: Sequence[Batch]) -> list[int]:
    """The number of samples in each micro-batch of ``value`` (the length of the first
    tensor that :func:`~gpipe_microbatch.scatter` split)."""
    index = 0
    for item in values_of(value):
        if isinstance(item, torch.Tensor):
            break
        index += isinstance(item, NoChunk)
    return [len(batch[index]) for batch in batches]


def positional(inputs: tuple[Any, ...]) -> tuple[object, bool, str]:
    """The mini-batch of ``forward(*inputs)`` and ``step(*inputs, ...)``: the value,
    whether its tuple is the first layer's positional arguments, and how error messages
    name it."""
    if not inputs:
        raise TypeError(
            "GPipe needs an input: the first layer's positional or keyword arguments, at "
            "least one of them holding a tensor to split into micro-batches (inputs: ())"
        )
    if len(inputs) == 1:
        return inputs[0], False, "input"
    return inputs, True, "inputs"


#: The mean of this rank's count of a :class:`~gpipe_core.BatchMean` over the data-parallel
#: replicas (the count itself without replicas); None: this replica failed before it had
#: one (the others then raise). See :meth:`~gpipe_core.transport._data_parallel.Replicas.mean`.
CountMean = Callable[[float | None], float]


def _alone(count: float | None) -> float:
    return 0.0 if count is None else count


class FirstCall(NamedTuple):
    """How the first layer is called on the mini-batch of ``forward(*inputs, **keywords)``.

    Attributes:
        value: the mini-batch: one value, or the tuple of the positional arguments followed
            by the keyword arguments' values.
        unpack: whether the tuple is the first layer's arguments.
        what: how error messages name the mini-batch.
        keywords: the names of the keyword arguments, the last values of the tuple.
        names: how error messages name each value of the tuple (None: ``what[k]``).
    """

    value: object
    unpack: bool
    what: str
    keywords: tuple[str, ...] = ()
    names: list[str] | None = None


def first_call(inputs: tuple[Any, ...], keywords: Mapping[str, Any]) -> FirstCall:
    """The mini-batch of ``forward(*inputs, **keywords)`` (see :class:`FirstCall`): with
    keyword arguments, the first layer is called ``layer(*inputs, **keywords)``, each value
    split like a positional one; without, as :func:`positional` says.

    Raises:
        TypeError: neither positional nor keyword arguments.

    Example:
        >>> call = first_call((1,), {"mask": 2})
        >>> call.value, call.keywords, call.names
        ((1, 2), ('mask',), ['inputs[0]', 'mask'])
    """
    if not keywords:
        return FirstCall(*positional(inputs))
    names = [f"inputs[{k}]" for k in range(len(inputs))] + list(keywords)
    return FirstCall((*inputs, *keywords.values()), True, "inputs", tuple(keywords), names)


#: ``step()``'s ``target`` when it is not given by keyword.
UNSET: Any = object()


def check_input_device(
    value: object,
    what: str,
    devices: Sequence[torch.device],
    labels: Sequence[str] | None = None,
) -> None:
    """Refuse a tensor of the input ``value`` (named ``what`` in errors, its values
    ``labels`` if given) that is not on the first partition's device (an empty pipeline
    takes its input where it is)."""
    if not devices:
        return
    expected = devices[0]
    for where, item in zip(labels or microbatch_labels(value, what), values_of(value), strict=True):
        tensor = tensor_of(item)
        if tensor is not None and tensor.device != expected:
            raise ValueError(
                f"{where} must be on the first partition's device "
                f"(devices[0]: {expected}, {where}: {tensor.device})"
            )


def check_reduction(loss_fn: object, reduction: object) -> Reduction:
    if isinstance(loss_fn, BatchMean):
        if reduction not in (None, "mean"):
            raise ValueError(
                "a BatchMean loss is a mean over the mini-batch's count; reduction must be "
                f"'mean' or not given (reduction: {reduction!r})"
            )
        return "mean"
    if reduction is None:
        reduction = getattr(loss_fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(
                "loss_fn must reduce each micro-batch's loss to a scalar by 'mean' or 'sum' "
                f"(loss_fn.reduction: {reduction!r})"
            )
    elif reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (reduction: {reduction!r})")
    else:
        declared = getattr(loss_fn, "reduction", reduction)
        if declared != reduction:
            # The gradients would be scaled for one reduction and computed with the other.
            raise ValueError(
                "reduction must match loss_fn.reduction when loss_fn has one "
                f"(reduction: {reduction!r}, loss_fn.reduction: {declared!r})"
            )
    return "sum" if reduction == "sum" else "mean"


def check_loss_denominator(loss_fn: object, target: object, micro_batches: int) -> None:
    """Refuse a :class:`~torch.nn.CrossEntropyLoss` or :class:`~torch.nn.NLLLoss` averaged
    over a count that depends on the data (ignored targets, class weights) when the step
    splits the batch into several micro-batches: each micro-batch would be divided by its
    own count, and the step's loss and gradients would not be the plain model's.

    Only integer (class index) targets are looked at: their count is the data's. Looking
    for an ignored target reads the target (a synchronization where it is on a GPU).
    """
    if micro_batches < 2 or not isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
        return
    if loss_fn.reduction != "mean" or not isinstance(target, torch.Tensor):
        return
    if target.is_floating_point():
        return
    name = type(loss_fn).__name__
    if loss_fn.weight is not None:
        why = f"{name}(weight=...) divides each micro-batch by the sum of its targets' weights"
    else:
        ignored = int((target == loss_fn.ignore_index).sum())
        if not ignored:
            return
        why = (
            f"{name}(ignore_index={loss_fn.ignore_index}) divides each micro-batch by the "
            f"targets it keeps ({ignored} of the target's {target.numel()} are ignored)"
        )
    raise ValueError(
        f"loss_fn {why}, not by the mini-batch's count: with {micro_batches} micro-batches "
        "the loss and gradients would differ from the plain model's. Pass "
        "loss_fn=gpipe_core.BatchMean.from_module(loss_fn), which divides every micro-batch "
        "by the whole mini-batch's count, or reduction='sum' losses"
    )


class Leaves:
    """A step's input (or target) cut from the caller's graph, and its gradient passed back.

    Each micro-batch's backward pass accumulates the gradient of its slice into one leaf
    per tensor (a NoChunk tensor's leaf gets every micro-batch's gradient); :meth:`backward`
    then hands the whole gradient to the caller's graph at once, as one backward pass over
    the mini-batch would. Values that are not tensors are kept as they are.
    """

    def __init__(self, value: object, backward: bool) -> None:
        values = values_of(value)
        tensors = tuple(t for t in map(tensor_of, values) if t is not None)
        self.originals: tuple[torch.Tensor, ...] = ()
        self.leaves: tuple[torch.Tensor, ...] = ()
        self.value = value
        if backward and any(tensor.requires_grad for tensor in tensors):
            self.originals = tensors
            self.leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
            leaves = iter(self.leaves)
            cut = tuple(
                NoChunk(next(leaves))
                if isinstance(item, NoChunk)
                else next(leaves)
                if isinstance(item, torch.Tensor)
                else item
                for item in values
            )
            self.value = with_values(value, cut)

    def backward(self) -> None:
        pairs = [
            (original, leaf.grad)
            for original, leaf in zip(self.originals, self.leaves, strict=True)
            if original.requires_grad and leaf.grad is not None
        ]
        self.originals = self.leaves = ()
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class RunInputs:
    """One run's inputs on this process, checked and split.

    Attributes:
        batches: the input's micro-batches (none off the first partition's rank).
        sizes: the number of samples in each micro-batch (on every rank).
        unpack: whether the input is a tuple of the first layer's positional arguments.
        keywords: the names of the first layer's keyword arguments, the last values of
            the input tuple.
        schedule: the step's schedule (a forward's: fill-drain).
        loss: the loss spec, on the last partition's rank of a step (None elsewhere).
        output: an empty pipeline's forward output (its input; None otherwise).
    """

    def __init__(
        self,
        batches: list[Batch],
        sizes: list[int],
        unpack: bool,
        schedule: Schedule,
        *,
        reduction: Reduction = "mean",
        backward: bool = False,
        input: Leaves | None = None,
        keywords: tuple[str, ...] = (),
    ) -> None:
        self.batches = batches
        self.keywords = keywords
        self.sizes = sizes
        self.unpack = unpack
        self.schedule = schedule
        self.reduction = reduction
        #: Whether the step differentiates (grad mode on).
        self.backward = backward
        self.loss: LossSpec | None = None
        self.output: object = None
        self._input = input
        self._target: Leaves | None = None

    def identity(self) -> None:
        """The step of an empty pipeline, the identity: the losses of the input itself."""
        losses = self.loss
        assert losses is not None and self._input is not None and self._target is not None
        with torch.set_grad_enabled(self.backward):
            for i, batch in enumerate(self.batches):
                loss = losses(i, batch)
                if self.backward:
                    torch.autograd.backward(loss, losses.seed(i, loss))

    def end(self) -> Losses | None:
        """Hand the gradients of the step's input and target to the caller's graph; the
        losses (on the last partition's rank; None elsewhere)."""
        if self._input is not None:
            self._input.backward()
        if self._target is not None:
            self._target.backward()
        if self.loss is None:
            return None
        return self.loss.result(self.sizes, self.reduction)


def _split(
    value: object, call: FirstCall, chunks: int, share: Share, fields: Fields, *, first: bool
) -> tuple[list[Batch], list[int]]:
    """The micro-batches of ``value`` (named as ``call`` says in errors) and their sizes, on
    the first partition's rank (``first``); on other ranks, no micro-batches, and their
    sizes from that rank, which sends them with the run's ``fields``."""
    batches = scatter(value, chunks, what=call.what, names=call.names) if first else []
    plan = (batch_sizes(value, batches),) if first else None
    (sizes,) = share(plan, fields)
    return batches, list(sizes)


def forward_inputs(
    inputs: tuple[Any, ...],
    keywords: Mapping[str, Any],
    chunks: int,
    devices: Sequence[torch.device],
    share: Share,
    *,
    training: bool,
    first: bool,
    method: str = "forward",
    agree: Fields = (),
) -> RunInputs:
    """``forward(*inputs, **keywords)``'s inputs, split into ``chunks`` micro-batches (the
    input's on the first partition's rank, ``first``; the other ranks read none). An empty
    pipeline (no ``devices``) is the identity: its :attr:`~RunInputs.output` is its input,
    as the first layer would see it. The ranks agree on the run of ``method`` and on
    ``agree`` besides.

    Raises:
        TypeError: no input, an input without a tensor to split, or keyword inputs to an
            empty pipeline.
        ValueError: a tensor is not on ``devices[0]``, or the tensors to split have
            different batch sizes.
    """
    call = FirstCall(None, False, "input")
    fields = (*run_fields(method, chunks=chunks, training=training), *agree)
    if first:
        call = first_call(inputs, keywords)
        check_input_device(call.value, call.what, devices, call.names)
        if not devices:
            if keywords:
                raise TypeError(
                    "an empty pipeline is the identity of one input and takes no keyword "
                    f"inputs (keywords: {list(keywords)})"
                )
            scatter(call.value, chunks, what=call.what)  # the same checks
            given = RunInputs([], [], call.unpack, GPipeSchedule())
            given.output = scatter(call.value, 1, what=call.what)[0].value
            return given
    batches, sizes = _split(call.value, call, chunks, share, fields, first=first)
    return RunInputs(batches, sizes, call.unpack, GPipeSchedule(), keywords=call.keywords)


class _TellingReplicas:
    """The count of a :class:`~gpipe_core.BatchMean` given to ``count_mean`` at most once
    (calling it), and, if the step fails before on the last partition's rank
    (``last``), None in its place: the data-parallel replicas wait for one or the other."""

    def __init__(self, count_mean: CountMean, *, last: bool) -> None:
        self.count_mean = count_mean
        self.last = last
        self.told = False
        #: Whether the step's loss is a BatchMean (known once its arguments are read).
        self.batch_mean = False

    def __call__(self, count: float | None) -> float:
        self.told = True
        return self.count_mean(count)

    def __enter__(self) -> _TellingReplicas:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        if error is not None and self.last and self.batch_mean and not self.told:
            self.count_mean(None)


def step_inputs(
    inputs: tuple[Any, ...],
    keywords: Mapping[str, Any],
    target: object,
    loss_fn: object,
    schedule: str | Schedule,
    reduction: Reduction | None,
    *,
    chunks: int,
    devices: Sequence[torch.device],
    share: Share,
    training: bool,
    ends: tuple[bool, bool],
    count_mean: CountMean = _alone,
) -> RunInputs:
    """``step(*inputs, target=..., loss_fn=..., schedule=..., reduction=...)``'s inputs:
    read (the first layer's positional arguments, as ``forward(*inputs)``'s are, or the
    shorthand for one input ``step(input, target, loss_fn)``), checked, cut from the
    caller's graph when grad mode is on, and split into ``chunks`` micro-batches:
    the input on the first partition's rank, the target on the last partition's (``ends``
    says whether each runs here), moved to its device (``devices[-1]``).

    With a :class:`~gpipe_core.BatchMean`, the last partition's rank gives ``count_mean`` its
    count once, or None if the step fails before: the data-parallel replicas sum their
    counts so, and learn there of a replica that failed.

    Raises:
        TypeError: the arguments are not read either way, or ``loss_fn`` is not callable.
        ValueError: the input is not on ``devices[0]``, an unknown schedule or reduction,
            or ``target``'s batch size differs from the input's.
        RuntimeError: the step is called inside a checkpointed function.
    """
    with _TellingReplicas(count_mean, last=ends[1]) as counting:
        call = FirstCall(None, False, "input")
        if target is not UNSET and loss_fn is not None:
            if inputs or keywords:
                call = first_call(inputs, keywords)
        elif target is UNSET and loss_fn is None and len(inputs) == 3:
            target, loss_fn = inputs[1:]
            call = first_call(inputs[:1], keywords)
        else:
            seen = ", ".join(
                f"{name}: {'given' if present else 'missing'}"
                for name, present in (
                    ("target", target is not UNSET),
                    ("loss_fn", loss_fn is not None),
                )
            )
            raise TypeError(
                "step() takes the first layer's positional arguments with target and loss_fn by "
                "keyword, step(*inputs, target=..., loss_fn=..., **keywords), or one input, its "
                "target and the loss function positionally, step(input, target, loss_fn) "
                f"({len(inputs)} positional arguments given; {seen})"
            )
        counting.batch_mean = isinstance(loss_fn, BatchMean)
        first, last = ends
        value = call.value
        if first:
            check_input_device(value, call.what, devices, call.names)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (loss_fn: {type(loss_fn).__name__})")
        checked = check_reduction(loss_fn, reduction)
        resolved = get_schedule(schedule)
        if is_checkpointing() or is_recomputing():
            raise RuntimeError(
                "GPipe.step cannot run inside a checkpointed or recomputed function "
                f"(checkpointing: {is_checkpointing()}, recomputing: {is_recomputing()})"
            )
        backward = torch.is_grad_enabled()  # in eval mode too, as autograd does
        fields = run_fields(
            "step", chunks=chunks, schedule=schedule, reduction=checked, training=training
        )
        cut = Leaves(value, backward) if first else None
        batches, sizes = _split(
            cut.value if cut else None, call, chunks, share, fields, first=first
        )
        given = RunInputs(
            batches, sizes, call.unpack, resolved, reduction=checked, backward=backward, input=cut,
            keywords=call.keywords,
        )  # fmt: skip
        if last:
            given._target = Leaves(target, backward)
            device = devices[-1] if devices else None
            given.loss = _losses(
                given._target.value, sizes, chunks, device, loss_fn, checked, backward, counting
            )
        return given


def _losses(
    target: object,
    sizes: Sequence[int],
    chunks: int,
    device: torch.device | None,
    loss_fn: LossFunction,
    reduction: Reduction,
    backward: bool,
    count_mean: CountMean,
) -> LossSpec:
    """The losses of the last partition: ``target`` split into micro-batches of the
    input's ``sizes`` and moved to ``device``, each micro-batch's loss scaled for
    ``reduction``; with a :class:`~gpipe_core.BatchMean`, by one over the mini-batch's count
    (its mean over the data-parallel replicas, ``count_mean``, whose gradients are then
    averaged).

    Raises:
        ValueError: ``target``'s batch size differs from the input's, or a loss whose
            count depends on the data with several micro-batches
            (:func:`check_loss_denominator`).
    """
    check_loss_denominator(loss_fn, target, len(sizes))
    targets = scatter(target, chunks, what="target")
    target_sizes = batch_sizes(target, targets)
    if list(sizes) != target_sizes:
        raise ValueError(
            "target must have the input's batch size "
            f"(input: {sum(sizes)}, target: {sum(target_sizes)})"
        )
    if device is not None:
        targets = [
            batch if all(t.device == device for t in batch) else to_device(batch, device)
            for batch in targets
        ]
    total = sum(sizes)
    if isinstance(loss_fn, BatchMean):
        counts = [float(loss_fn.count(batch.value)) for batch in targets]
        mean = count_mean(sum(counts))
        # Counting nothing, the plain model's loss is 0 / 0 and its gradients NaN.
        scale = 1.0 / mean if mean else math.nan
        return LossSpec(loss_fn, targets, [scale] * len(targets), backward, counts, total)
    scales = [size / total if reduction == "mean" and total else 1.0 for size in sizes]
    return LossSpec(loss_fn, targets, scales, backward, batch_size=total)
