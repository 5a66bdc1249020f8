"""The checks of :class:`~gpipe_core.GPipe`'s arguments: each refusal of an argument of the
constructor, :meth:`~gpipe_core.GPipe.forward` or :meth:`~gpipe_core.GPipe.step`, made
before anything changes, saying what was wrong and the value seen.

This module owns what an argument may be. It must not know partitions, runs or transports:
a process group is only checked to be one this process belongs to.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from gpipe_checkpoint import is_checkpointing, is_recomputing
from gpipe_microbatch import Device, check_chunks, check_module
from gpipe_skip import verify_skippables

from ._partition import balance_from_placement, placed_layers
from ._placement import check_timeout
from .run._inputs import StepArguments, items, tensor_of
from .run._losses import LossFunction, Reduction
from .run._threads import check_intra_op_threads
from .schedule._schedules import Schedule, get_schedule
from .transport._groups import check_group

__all__ = [
    "Checked",
    "CheckpointMode",
    "check_checkpoint",
    "check_construction",
    "check_data_group_devices",
    "check_input_device",
    "check_reduction",
    "check_step",
]

CheckpointMode = Literal["always", "except_last", "never"]
_CHECKPOINT_MODES = ("always", "except_last", "never")


def check_checkpoint(checkpoint: object) -> CheckpointMode:
    if checkpoint not in _CHECKPOINT_MODES:
        raise ValueError(
            "checkpoint must be one of 'always', 'except_last', 'never' "
            f"(checkpoint: {checkpoint!r})"
        )
    return cast(CheckpointMode, checkpoint)


def check_reduction(loss_fn: object, reduction: object) -> Reduction:
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


class Checked(NamedTuple):
    """The constructor's arguments, checked (and ``balance`` and ``devices`` found from
    where the layers are, when neither is given)."""

    balance: Iterable[int]
    devices: Iterable[Device] | None
    chunks: int
    checkpoint: CheckpointMode
    timeout: float | None
    intra_op_threads: int | None


def check_construction(
    module: nn.Sequential,
    balance: Iterable[int] | None,
    devices: Iterable[Device] | None,
    chunks: int,
    checkpoint: CheckpointMode,
    deferred_batch_norm: bool,
    group: dist.ProcessGroup | None,
    data_group: dist.ProcessGroup | None,
    timeout: float | datetime.timedelta | None,
    intra_op_threads: int | None,
    placement: str | Sequence[int] | None,
) -> Checked:
    """The constructor's checks of its arguments one by one, which change nothing (the
    checks of ``balance`` and ``devices`` against the module are the placement's)."""
    check_module(module)
    if not isinstance(deferred_batch_norm, bool):
        raise TypeError(
            f"deferred_batch_norm must be True or False (deferred_batch_norm: "
            f"{deferred_batch_norm!r})"
        )
    # The skippable layers as the partitions will hold them: without WithDevice wrappers.
    verify_skippables(placed_layers(module))
    chunks = check_chunks(chunks)
    checkpoint = check_checkpoint(checkpoint)
    seconds = check_timeout(timeout, group if group is not None else data_group)
    threads = check_intra_op_threads(intra_op_threads)
    if data_group is not None:
        check_group(data_group, "data_group")
    if group is not None and balance is None:
        raise TypeError(
            "balance must be given with group (balance: None): it says which layers each rank runs"
        )
    if balance is None and placement is not None:
        raise TypeError(
            f"balance must be given with placement (balance: None, placement: {placement!r})"
        )
    if balance is None and devices is None:
        balance, devices = balance_from_placement(module)
    elif balance is None:
        raise TypeError(
            "balance must be given with devices (balance: None, devices: "
            f"{devices!r}); without both, partitions follow where the layers are"
        )
    return Checked(balance, devices, chunks, checkpoint, seconds, threads)


def check_data_group_devices(
    data_group: dist.ProcessGroup | None, devices: Sequence[torch.device]
) -> None:
    """Refuse a NCCL ``data_group`` for this rank's partitions on ``devices`` unless all are
    CUDA devices (NCCL averages CUDA tensors only)."""
    if data_group is None or str(dist.get_backend(data_group)) != "nccl":
        return
    on_host = [str(d) for d in devices]
    if any(not d.startswith("cuda") for d in on_host):
        raise ValueError(
            "data_group uses NCCL, which averages CUDA tensors only, and this rank's "
            f"partitions are not all on CUDA devices (data_group backend: 'nccl', "
            f"devices of this rank: {on_host}); use a gloo group, or one of "
            "init_process_group('cpu:gloo,cuda:nccl')"
        )


def check_input_device(value: object, what: str, devices: Sequence[torch.device]) -> None:
    """Refuse a tensor of the input ``value`` (named ``what`` in errors) that is not on the
    first partition's device (an empty pipeline takes its input where it is)."""
    if not devices:
        return
    expected = devices[0]
    for index, item in enumerate(items(value)):
        tensor = tensor_of(item)
        if tensor is not None and tensor.device != expected:
            where = f"{what}[{index}]" if isinstance(value, tuple) else what
            raise ValueError(
                f"{where} must be on the first partition's device "
                f"(devices[0]: {expected}, {where}: {tensor.device})"
            )


def check_step(
    arguments: StepArguments,
    schedule: str | Schedule,
    reduction: Reduction | None,
    devices: Sequence[torch.device],
    *,
    first: bool,
) -> tuple[Schedule, Reduction, LossFunction]:
    """The step's checks of its arguments (the input's on the first partition's rank,
    ``first``): its schedule, reduction and loss function."""
    input, loss_fn = arguments.input, arguments.loss_fn
    if first and arguments.unpack and not isinstance(input, tuple):
        raise TypeError(
            "unpack_input=True takes a tuple of the first layer's positional arguments "
            f"(input: {type(input).__name__})"
        )
    if first:
        check_input_device(input, arguments.what, devices)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (loss_fn: {type(loss_fn).__name__})")
    checked = check_reduction(loss_fn, reduction)
    plan = get_schedule(schedule)
    if is_checkpointing() or is_recomputing():
        raise RuntimeError(
            "GPipe.step cannot run inside a checkpointed or recomputed function "
            f"(checkpointing: {is_checkpointing()}, recomputing: {is_recomputing()})"
        )
    return plan, checked, loss_fn
