"""A pipeline on a :class:`~torch.distributed.device_mesh.DeviceMesh` (``GPipe(...,
mesh=mesh)``): which of the mesh's groups runs the pipeline, which average gradients, and
how each rank's partitions are sharded with torch's FSDP2
(:func:`torch.distributed.fsdp.fully_shard`).

The mesh's dimensions are torchtitan's names: ``"pp"`` (the pipeline: its group is what
``group=`` is without a mesh), ``"dp_replicate"`` (replicas that average their gradients
after each step, as ``data_group=`` does), ``"dp_shard"`` (each local partition sharded
with ``fully_shard`` over it; with ``"dp_replicate"`` too, HSDP over both) and ``"tp"``
(the layers are the user's, parallelized over it with torch's ``parallelize_module``
before the pipeline is built: their parameters are DTensors of ``mesh["tp"]``, and what
crosses between partitions is what the layers return). :func:`check_mesh`
refuses a mesh gpipe cannot run before anything changes, and returns a :class:`MeshGroups`;
:func:`check_mesh_layout` refuses what only the placement and the module's ties show;
:func:`shard_partitions` shards the partitions once they are built.

This module knows nothing of runs or transports: the runs learn which partitions are
sharded from the partitions themselves (see :mod:`gpipe_core.run._gradient_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._sequential import FirstLayerCall

__all__ = [
    "MESH_DIMENSIONS",
    "MeshGroups",
    "check_mesh",
    "check_mesh_layout",
    "check_not_sharded",
    "shard_partitions",
]

#: The dimension names gpipe runs a pipeline on.
MESH_DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "tp")
#: torchtitan's names that gpipe does not run yet, refused by name.
_NOT_YET = {
    "cp": "context parallelism ('cp') is not supported yet",
    "ep": "expert parallelism ('ep') is not supported yet",
}


@dataclass(frozen=True)
class MeshGroups:
    """What a pipeline runs on, from its mesh.

    Attributes:
        pipeline: ``mesh["pp"]``'s group: the ranks that run the partitions (``group``).
        replicate: ``mesh["dp_replicate"]``'s group (None without that dimension).
        shard_mesh: the mesh each local partition is sharded over with ``fully_shard``:
            ``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` (HSDP); None
            without ``"dp_shard"``.
        counted: the data-parallel groups whose ranks each pass their own share of the
            mini-batch (every data-parallel dimension's), over which the counts of a
            :class:`~gpipe_core.BatchMean` are summed.
        pp_size: the size of ``mesh["pp"]``.
        reshard_after_forward: whether sharded partitions free their gathered parameters
            after each micro-batch's forward pass.
        device_type: the mesh's device type (``"cpu"``, ``"cuda"``).
        tensor_mesh: ``mesh["tp"]``, the mesh the layers' DTensors are parallelized over
            (None without ``"tp"``).
    """

    pipeline: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    shard_mesh: DeviceMesh | None
    counted: tuple[dist.ProcessGroup, ...]
    pp_size: int
    reshard_after_forward: bool
    device_type: str
    tensor_mesh: DeviceMesh | None = None

    @property
    def averaged(self) -> dist.ProcessGroup | None:
        """The group gpipe averages the gradients over after a step (``data_group``):
        ``"dp_replicate"``'s without ``"dp_shard"`` (with it, FSDP's HSDP reduces over both
        dimensions itself)."""
        return self.replicate if self.shard_mesh is None else None


def check_mesh(
    mesh: object,
    group: object,
    data_group: object,
    reshard_after_forward: object,
) -> MeshGroups | None:
    """``mesh`` checked (None: no mesh), with ``reshard_after_forward``: what the pipeline
    runs on. Changes nothing.

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``, or ``reshard_after_forward`` not a
            bool.
        ValueError: ``mesh`` together with ``group`` or ``data_group``; a mesh without
            ``"pp"``, with a dimension gpipe does not know or does not run yet
            (``"cp"``, ``"ep"``), without names, or with ``"dp_shard"`` before
            ``"dp_replicate"``;
            ``reshard_after_forward`` without ``"dp_shard"``.
    """
    if mesh is None:
        if reshard_after_forward is not None:
            raise ValueError(
                "reshard_after_forward applies to partitions sharded over a mesh's "
                f"'dp_shard' dimension and needs mesh (reshard_after_forward: "
                f"{reshard_after_forward!r}, mesh: None)"
            )
        return None
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (mesh: {mesh!r})")
    pairs = (("group", group), ("data_group", data_group))
    given = [name for name, value in pairs if value is not None]
    if given:
        raise ValueError(
            f"mesh replaces group and data_group: pass either mesh or {' and '.join(given)} "
            f"(mesh: {mesh!r}, {', '.join(f'{name}: given' for name in given)}); the "
            "mesh's 'pp' dimension is the pipeline's group and 'dp_replicate' its data_group"
        )
    names = list(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            "mesh must name its dimensions, among "
            f"{list(MESH_DIMENSIONS)} (mesh: {mesh!r}, mesh_dim_names: None); make it with "
            "init_device_mesh(..., mesh_dim_names=('pp', 'dp_shard'))"
        )
    for name in names:
        if name in _NOT_YET:
            raise ValueError(
                f"mesh has dimension {name!r}, and {_NOT_YET[name]} (mesh_dim_names: "
                f"{tuple(names)}); gpipe runs a mesh of {list(MESH_DIMENSIONS)}: leave "
                f"{name!r} out of the mesh"
            )
        if name not in MESH_DIMENSIONS:
            raise ValueError(
                f"mesh has dimension {name!r}, which gpipe does not know (mesh_dim_names: "
                f"{tuple(names)}); its dimensions are {list(MESH_DIMENSIONS)}"
            )
    if "pp" not in names:
        raise ValueError(
            "mesh must have a 'pp' dimension, the ranks that run the partitions "
            f"(mesh_dim_names: {tuple(names)}); add one, of size 1 for no pipeline across ranks"
        )
    order = [name for name in names if name.startswith("dp_")]
    if order == ["dp_shard", "dp_replicate"]:
        raise ValueError(
            "mesh must have 'dp_replicate' before 'dp_shard', the order HSDP shards in "
            f"(mesh_dim_names: {tuple(names)})"
        )
    sharded = "dp_shard" in names
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward must be True or False (reshard_after_forward: "
            f"{reshard_after_forward!r})"
        )
    if reshard_after_forward is not None and not sharded:
        raise ValueError(
            "reshard_after_forward applies to partitions sharded over a mesh's 'dp_shard' "
            f"dimension (reshard_after_forward: {reshard_after_forward!r}, mesh_dim_names: "
            f"{tuple(names)})"
        )
    replicate = mesh["dp_replicate"].get_group() if "dp_replicate" in names else None
    shard_mesh = None
    if sharded:
        both = "dp_replicate" in names
        shard_mesh = mesh["dp_replicate", "dp_shard"] if both else mesh["dp_shard"]
    counted = tuple(
        mesh[name].get_group() for name in ("dp_shard", "dp_replicate") if name in names
    )
    return MeshGroups(
        pipeline=mesh["pp"].get_group(),
        replicate=replicate,
        shard_mesh=shard_mesh,
        counted=counted,
        pp_size=mesh["pp"].size(),
        reshard_after_forward=True if reshard_after_forward is None else reshard_after_forward,
        device_type=mesh.device_type,
        tensor_mesh=mesh["tp"] if "tp" in names else None,
    )


def check_not_sharded(module: nn.Module, tensor_mesh: DeviceMesh | None) -> None:
    """Refuse a ``module`` that torch's data parallelism wrapped already: FSDP1
    (``FullyShardedDataParallel``), FSDP2 (``fully_shard``), or parameters that are
    DTensors on another mesh than ``tensor_mesh`` (``mesh["tp"]``, which the layers are
    parallelized over before the pipeline is built; without ``"tp"``, none). gpipe splits
    the layers, then shards each partition itself over ``"dp_shard"``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for name, sub in module.named_modules():
        where = f"module {name!r}" if name else "the module itself"
        if isinstance(sub, FullyShardedDataParallel):
            raise TypeError(
                f"module must hold plain layers, and {where} is wrapped in FSDP1's "
                "FullyShardedDataParallel; pass the unwrapped model, and "
                "mesh=init_device_mesh(..., mesh_dim_names=('pp', 'dp_shard')) to shard each "
                "partition with FSDP2"
            )
        if isinstance(sub, FSDPModule):
            raise TypeError(
                f"module must hold plain layers, and {where} is fully_shard-ed already "
                f"({type(sub).__name__}); pass the model before fully_shard, and "
                "mesh=init_device_mesh(..., mesh_dim_names=('pp', 'dp_shard')): gpipe "
                "shards each partition itself"
            )
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and (tensor_mesh is None or p.device_mesh != tensor_mesh):
            raise TypeError(
                f"module must hold plain parameters, or DTensors of the layers parallelized "
                f"over mesh['tp'], and {name!r} is a DTensor on another mesh (its mesh: "
                f"{p.device_mesh}, mesh['tp']: {tensor_mesh}); parallelize the model with "
                "parallelize_module(model, mesh['tp'], plan) before building the pipeline"
            )


def check_mesh_layout(
    groups: MeshGroups,
    workers: Sequence[int],
    placement: object,
    shared: Sequence[tuple[str, Sequence[int]]],
    ranks: Sequence[int],
    devices: Sequence[torch.device],
) -> None:
    """Refuse a mesh whose ``"pp"`` size is not the number of the partitions' workers (one
    worker per rank: every data-parallel rank issues its collectives in one order), a
    tensor tied between sharded partitions of one rank (``shared``: each tied tensor's key
    and the partitions that use it; ``ranks``: each partition's rank), whose two FSDP units
    would each shard it apart, or a mesh of another device type than this rank's
    partitions (``devices``). A tensor tied between partitions of different ranks is
    kept equal as without a mesh, shard by shard (see :mod:`gpipe_core._shared`)."""
    count = max(workers, default=-1) + 1
    if count != groups.pp_size:
        raise ValueError(
            f"mesh['pp'] must have one rank per worker of the partitions (mesh['pp'].size(): "
            f"{groups.pp_size}, workers: {count}, partitions: {len(workers)}, placement: "
            f"{placement!r}); give balance {groups.pp_size} partitions, or several per rank "
            "with placement='loop' or 'v'"
        )
    for key, partitions in shared if groups.shard_mesh is not None else ():
        on = [ranks[j] for j in sorted(set(partitions))]
        if len(on) > len(set(on)):
            raise ValueError(
                "a tensor tied between partitions of one rank cannot be sharded over "
                f"mesh['dp_shard'] (tied: {key!r}, its partitions: {sorted(set(partitions))}, "
                f"their ranks: {on}, placement: {placement!r}); keep its uses in one "
                "partition, on different ranks, or use 'dp_replicate' instead of 'dp_shard'"
            )
    types = sorted({device.type for device in devices})
    if any(kind != groups.device_type for kind in types):
        raise ValueError(
            f"mesh is on {groups.device_type!r} and this rank's partitions are on {types} "
            f"(mesh device_type: {groups.device_type!r}); make the mesh on the partitions' "
            "device type"
        )


def shard_partitions(partitions: Sequence[nn.Module], groups: MeshGroups) -> None:
    """Shard each partition with parameters in ``partitions`` (this rank's) with
    ``fully_shard`` over ``groups.shard_mesh``: one FSDP unit per partition, whose
    parameters are gathered once for its forward pass and once for its backward pass of a
    micro-batch (once per step without ``reshard_after_forward``), and whose gradients are
    reduce-scattered once per step (see :mod:`gpipe_core.run._gradient_sync`)."""
    if groups.shard_mesh is None:
        return
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for partition in partitions:
        if not any(True for _ in partition.parameters()):
            continue
        if type(partition) is nn.Sequential:
            # Called as one module also with several inputs, so that FSDP's hooks run.
            partition.__class__ = FirstLayerCall
        sharded = fully_shard(partition, mesh=groups.shard_mesh)
        assert isinstance(sharded, FSDPModule)
        # A root unit keeps its parameters gathered after forward unless told: the
        # pipeline's choice for every partition.
        sharded.set_reshard_after_forward(groups.reshard_after_forward)
        # What the runs' gradient sync reads (see gpipe_core.run._gradient_sync).
        vars(partition)["_gpipe_reshard_after_forward"] = groups.reshard_after_forward
