"""Building a :class:`~gpipe_core.GPipe`: from its arguments to its partitions, and its
runs' descriptions from what it built.

This module owns the constructor's order of work: the arguments' checks
(:func:`~gpipe_core._arguments.check_construction`); across processes, the ranks' agreement on
what they build; then the module's deferred batch norms, its split into partitions, the skip
layout, the shared tensors' ties and replicas. What it builds it returns, one
:class:`Configuration` that the module keeps whole, which describes each run
(:meth:`Configuration.describe`) from the run's inputs. It must not know how a run goes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

from torch import nn

from gpipe_bn import DeferredBatchNorm, convert_deferred_batch_norm
from gpipe_skip import SkipLayout, inspect_skip_layout

from ._arguments import Arguments, CheckpointMode, check_construction, check_data_group_devices
from ._materialize import InitStep
from ._mesh import check_mesh_layout, shard_partitions
from ._partition import check_module_balance, check_split, layer_groups, placed_layers, split_module
from ._placement import Placement
from ._sequential import PipeSequential
from ._shared import SharedReplicas, Ties, find_shared
from ._state_dict import Renaming, shown
from .run._draws import SelfCheckpointing
from .transport._agreement import Construction, layer_fields
from .transport._data_parallel import Replicas
from .transport._transport import Fields

__all__ = ["Configuration", "build"]


@dataclass
class Configuration:
    """What the constructor built, which the module keeps whole: its settings (``chunks``,
    ``checkpoint`` and ``intra_op_threads`` are the module's attributes), its partitions
    and placement, and what its runs need."""

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
    #: Which partitions checkpoint themselves, as the runs learn it.
    self_checkpointing: SelfCheckpointing = field(default_factory=SelfCheckpointing)


def build(
    arguments: Arguments,
    construction: Construction | None,
    renaming: Renaming | None = None,
    fields: Fields = (),
) -> Configuration:
    """The constructor's work: its ``arguments`` checked
    (:func:`~gpipe_core._arguments.check_construction`), then built, up to the ranks'
    agreement that each has built its partitions (``construction``, across processes), which
    is the module's to ask for.

    A subclass's ``renaming`` (a model's own names for the plain keys) names the tensors
    in errors, and its ``fields`` are agreed on by the ranks before the layers'."""
    checked = check_construction(arguments)
    module, group, data_group = checked.module, checked.group, checked.data_group
    deferred_batch_norm, placement_spec = checked.deferred_batch_norm, checked.placement
    seconds = cast(float | None, checked.timeout)
    assert checked.balance is not None  # found from where the layers are, if not given
    placement = Placement(
        check_module_balance(module, checked.balance),
        checked.devices,
        group,
        seconds,
        placement_spec,
    )
    balance, devices, local = placement.balance, placement.devices, placement.local
    check_data_group_devices(data_group, placement.local_devices())
    if deferred_batch_norm or construction is not None:
        # Every check that could refuse the module first: a refused module is unchanged.
        check_split(module, balance, devices)
    # The tensors that layers of several partitions share (tied weights), found before
    # a rank releases the other ranks' layers.
    shared = find_shared(layer_groups(module, balance))
    mesh = checked.mesh
    if mesh is not None:
        check_mesh_layout(
            mesh, placement.workers, placement_spec, [(s.key, s.partitions) for s in shared],
            placement.ranks, placement.local_devices(),
        )  # fmt: skip
    if construction is not None:
        fields = (
            ("the module's type", type(module).__qualname__),
            *fields,
            *layer_fields(placed_layers(module)),
            ("balance", balance),
            ("chunks", checked.chunks),
            ("checkpoint", checked.checkpoint),
            ("deferred_batch_norm", deferred_batch_norm),
            ("placement", placement.workers if placement_spec is not None else None),
            ("the rank of each partition", placement.ranks),
            (
                "the uses of each shared parameter or buffer",
                [[(j, shown(key, renaming)) for j, key in s.uses] for s in shared],
            ),
            (
                "the device types of each rank's partitions",
                sorted({device.type for device in placement.local_devices()}),
            ),
        )
        construction.agree(fields, seconds)
        # Every rank of the group makes them, here: constructing the pipeline is
        # collective over the group, as its steps are.
        placement.connect(construction.tag)
    replicas = Replicas(data_group, seconds, None if mesh is None else mesh.counted)
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
    partitions = split_module(
        module, balance, devices, local, cast(tuple[InitStep, ...], checked.init), renaming
    )
    if unpacks:
        partitions = [PipeSequential(OrderedDict(p._modules)) for p in partitions]
    if mesh is not None:
        shard_partitions([p for j, p in enumerate(partitions) if local[j]], mesh)
    layer_names = list(module._modules)
    parameter_names = [name for name, _ in placed_layers(module).named_parameters()]
    shared_replicas = SharedReplicas(shared, placement.ranks, partitions, group, seconds)
    # Partitions on other devices than a shared parameter's use a copy tied to it.
    Ties(shared, partitions, devices)
    return Configuration(
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
