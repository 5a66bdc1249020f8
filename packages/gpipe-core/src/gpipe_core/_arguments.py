"""The checks of :class:`~gpipe_core.GPipe`'s constructor arguments: each refusal of an
argument, made before anything changes, saying what was wrong and the value seen (those of
:meth:`~gpipe_core.GPipe.forward` and :meth:`~gpipe_core.GPipe.step` are
:mod:`gpipe_core.run._inputs`').

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

from gpipe_microbatch import Device, check_chunks, check_module
from gpipe_skip import verify_skippables

from ._materialize import Init, check_init
from ._mesh import MeshGroups, check_not_sharded
from ._partition import balance_from_placement, placed_layers
from ._placement import check_timeout
from .run._threads import check_intra_op_threads
from .transport._groups import check_group

__all__ = [
    "Arguments",
    "CheckpointMode",
    "check_checkpoint",
    "check_construction",
    "check_data_group_devices",
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


class Arguments(NamedTuple):
    """The constructor's arguments (see :class:`~gpipe_core.GPipe`), as given or checked
    (:func:`check_construction`)."""

    module: nn.Sequential
    balance: Iterable[int] | None
    devices: Iterable[Device] | None
    chunks: int
    checkpoint: CheckpointMode
    deferred_batch_norm: bool
    group: dist.ProcessGroup | None
    data_group: dist.ProcessGroup | None
    #: The bound of any wait for another rank; in seconds once checked (None: none).
    timeout: float | datetime.timedelta | None
    intra_op_threads: int | None
    placement: str | Sequence[int] | None
    #: How layers built on the meta device are initialised; a tuple of steps once checked.
    init: Init
    #: The mesh's groups (``mesh=``, checked by :func:`~gpipe_core._mesh.check_mesh`;
    #: ``group`` and ``data_group`` are then its own); None without a mesh.
    mesh: MeshGroups | None = None


def check_construction(arguments: Arguments) -> Arguments:
    """The constructor's checks of its ``arguments`` one by one, which change nothing (the
    checks of ``balance`` and ``devices`` against the module are the placement's): the
    arguments checked, ``timeout`` in seconds, and ``balance`` and ``devices`` found from
    where the layers are when neither is given."""
    module, balance, devices = arguments.module, arguments.balance, arguments.devices
    group, data_group, placement = arguments.group, arguments.data_group, arguments.placement
    deferred_batch_norm = arguments.deferred_batch_norm
    check_module(module)
    if arguments.mesh is not None:
        check_not_sharded(module, arguments.mesh.tensor_mesh)
    if not isinstance(deferred_batch_norm, bool):
        raise TypeError(
            f"deferred_batch_norm must be True or False (deferred_batch_norm: "
            f"{deferred_batch_norm!r})"
        )
    # The skippable layers as the partitions will hold them: without WithDevice wrappers.
    verify_skippables(placed_layers(module))
    chunks = check_chunks(arguments.chunks)
    checkpoint = check_checkpoint(arguments.checkpoint)
    seconds = check_timeout(arguments.timeout, group if group is not None else data_group)
    threads = check_intra_op_threads(arguments.intra_op_threads)
    init = check_init(arguments.init, list(module._modules))
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
    return arguments._replace(
        balance=balance, devices=devices, chunks=chunks, checkpoint=checkpoint,
        timeout=seconds, intra_op_threads=threads, init=init,
    )  # fmt: skip


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
