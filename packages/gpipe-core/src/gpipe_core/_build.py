"""Building a :class:`~gpipe_core.GPipe`: from its arguments to its partitions.

This module owns the constructor's order of work once the arguments are checked: across
processes, the ranks' agreement on what they build; then the module's deferred batch norms,
its split into partitions, the skip layout, the shared tensors' ties and replicas. What it
builds it returns (:class:`Built`); the module holds it. It must not know how a run goes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from gpipe_bn import DeferredBatchNorm, convert_deferred_batch_norm
from gpipe_skip import SkipLayout, inspect_skip_layout

from ._arguments import Checked, CheckpointMode, check_data_group_devices
from ._partition import check_balance, check_split, layer_groups, placed_layers, split_module
from ._placement import Placement
from ._sequential import PipeSequential
from ._shared import SharedReplicas, Ties, find_shared
from .transport._agreement import Construction, layer_fields
from .transport._data_parallel import Replicas

__all__ = ["Built", "build"]


@dataclass
class Built:
    """What the constructor built, for the module to hold."""

    chunks: int
    checkpoint: CheckpointMode
    intra_op_threads: int | None
    #: The bound of any wait for another rank (None: none).
    timeout: float | None
    placement: Placement
    replicas: Replicas
    #: Whether the module holds deferred batch norms (converted here or by hand).
    deferred_batch_norm: bool
    #: Whether the partitions keep a PipeSequential's calling convention.
    unpacks: bool
    skip_layout: SkipLayout
    #: This process's partitions (another rank's are empty).
    partitions: list[nn.Sequential]
    #: The names of the layers other ranks run.
    remote_layers: set[str]
    #: The layers' names, in the plain module's order.
    layer_names: list[str]
    #: The parameters' names, in the plain module's order (each shared one once).
    parameter_names: list[str]
    shared: SharedReplicas


def build(
    module: nn.Sequential,
    checked: Checked,
    deferred_batch_norm: bool,
    group: dist.ProcessGroup | None,
    data_group: dist.ProcessGroup | None,
    construction: Construction | None,
    placement_spec: str | Sequence[int] | None,
) -> Built:
    """The constructor's work once its arguments are ``checked``
    (:func:`~gpipe_core._arguments.check_construction`), up to the ranks' agreement that
    each has built its partitions (``construction``, across processes), which is the
    module's to ask for."""
    seconds = checked.timeout
    placement = Placement(
        check_balance(module, checked.balance), checked.devices, group, seconds, placement_spec
    )
    balance, devices, local = placement.balance, placement.devices, placement.local
    check_data_group_devices(data_group, placement.local_devices())
    if deferred_batch_norm or construction is not None:
        # Every check that could refuse the module first: a refused module is unchanged.
        check_split(module, balance, devices)
    # The tensors that layers of several partitions share (tied weights), found before
    # a rank releases the other ranks' layers.
    shared = find_shared(layer_groups(module, balance))
    if construction is not None:
        fields = (
            ("the module's type", type(module).__qualname__),
            *layer_fields(placed_layers(module)),
            ("balance", balance),
            ("chunks", checked.chunks),
            ("checkpoint", checked.checkpoint),
            ("deferred_batch_norm", deferred_batch_norm),
            ("placement", placement.workers if placement_spec is not None else None),
            ("the rank of each partition", placement.ranks),
            ("the uses of each shared parameter or buffer", [s.uses for s in shared]),
            (
                "the device types of each rank's partitions",
                sorted({device.type for device in placement.local_devices()}),
            ),
        )
        construction.agree(fields, seconds)
        # Every rank of the group makes them, here: constructing the pipeline is
        # collective over the group, as its steps are.
        placement.connect(construction.tag)
    replicas = Replicas(data_group, seconds)
    if deferred_batch_norm:
        convert_deferred_batch_norm(module, checked.chunks)  # in place: module is a container
    # Deferred batch norms, converted here or by hand, see each forward call as one
    # mini-batch; models without them skip the walk over their modules in forward.
    deferred = any(isinstance(m, DeferredBatchNorm) for m in module.modules())
    # From every partition, before a rank releases the others'.
    skip_layout = inspect_skip_layout(layer_groups(module, balance))
    remote_layers = {
        name
        for j, layers in enumerate(layer_groups(module, balance))
        if not local[j]
        for name in layers._modules
    }
    unpacks = isinstance(module, PipeSequential)
    partitions = split_module(module, balance, devices, local)
    if unpacks:
        partitions = [PipeSequential(OrderedDict(p._modules)) for p in partitions]
    layer_names = list(module._modules)
    parameter_names = [name for name, _ in placed_layers(module).named_parameters()]
    shared_replicas = SharedReplicas(shared, placement.ranks, partitions, group, seconds)
    # Partitions on other devices than a shared parameter's use a copy tied to it.
    Ties(shared, partitions, devices)
    return Built(
        chunks=checked.chunks,
        checkpoint=checked.checkpoint,
        intra_op_threads=checked.intra_op_threads,
        timeout=seconds,
        placement=placement,
        replicas=replicas,
        deferred_batch_norm=deferred,
        unpacks=unpacks,
        skip_layout=skip_layout,
        partitions=partitions,
        remote_layers=remote_layers,
        layer_names=layer_names,
        parameter_names=parameter_names,
        shared=shared_replicas,
    )
