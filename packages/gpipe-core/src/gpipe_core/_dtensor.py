"""DTensors where gpipe meets them: the parameters and gradients of partitions sharded over
a mesh's ``"dp_shard"`` (FSDP2) or of layers parallelized over its ``"tp"``.

Every layer may import it, and it imports nothing of gpipe-core's. It looks DTensor up
where something has imported it already: a pipeline without a mesh never imports
``torch.distributed.tensor`` (nor pays for it).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["gradient_like", "is_dtensor", "local_part", "settled"]


def _dtensor_type() -> Any:
    """The DTensor class, or None where ``torch.distributed.tensor`` is not imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded or parallelized parameter, its
    gradient)."""
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor, else the tensor itself.
    The ranks of one shard (and tensor-parallel) coordinate hold the same part of a
    parameter, so their parts are what they exchange, sum or average."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def gradient_like(parameter: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``part`` (this rank's) as a gradient of ``parameter``: a DTensor of the parameter's
    mesh, placements and shape where the parameter is one, else ``part`` itself."""
    if not is_dtensor(parameter):
        return part
    dtensor: Any = _dtensor_type()
    return dtensor.from_local(  # type: ignore[no-any-return]
        part, parameter.device_mesh, parameter.placements, run_check=False,  # type: ignore[attr-defined]
        shape=parameter.shape, stride=parameter.stride(),
    )  # fmt: skip


def settled(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its data there: the result of a collective that a layer left to
    finish (an ``AsyncCollectiveTensor``: a tensor-parallel layer's output, its input's
    gradient) waited for and unwrapped, as an operator on it would; any other tensor as it
    is. What crosses ranks as bytes must be one."""
    module = sys.modules.get("torch.distributed._functional_collectives")
    if module is not None and isinstance(tensor, module.AsyncCollectiveTensor):
        return tensor.wait()  # type: ignore[no-any-return]
    return tensor
