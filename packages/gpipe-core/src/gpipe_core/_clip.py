"""The gradient norm of a whole pipeline, for :meth:`GPipe.clip_grad_norm_
<gpipe_core.GPipe.clip_grad_norm_>`.

In one process the pipeline's parameters are the plain module's, and
:func:`torch.nn.utils.clip_grad_norm_` over them is the plain module's clipping. Across
processes, each rank holds some of them: each rank computes the norm of each gradient it
*counts* (its parameters, less the replicas of shared parameters whose owner another rank
holds, so that each is counted once), the ranks exchange these norms, and every rank
combines all of them in the plain module's order, as torch combines the norms of its
tensors: the same total norm on every rank, equal to the plain module's, and the same
clipping factor. Data-parallel replicas hold the same averaged gradients; the norm is over
the pipeline's group only, so they are not counted twice.

This module knows nothing of transports: it computes norms and combines the ones it is
given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real

import torch
from torch import nn

from ._dtensor import is_dtensor

__all__ = ["check_clip_arguments", "clip_by_norms", "combine", "gradient_norms"]


def check_clip_arguments(
    max_norm: object, norm_type: object, error_if_nonfinite: object
) -> tuple[float, float]:
    """``max_norm`` and ``norm_type`` as floats, taking every number
    :func:`torch.nn.utils.clip_grad_norm_` takes (a Python or NumPy number, a tensor or array
    of one real element; for ``norm_type`` also a string such as ``'inf'``); refuse what it
    could not use, naming the argument and the value seen."""
    numbers = (_number("max_norm", max_norm), _number("norm_type", norm_type, text=True))
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(
            f"error_if_nonfinite must be True or False (error_if_nonfinite: {error_if_nonfinite!r})"
        )
    return numbers


def _number(name: str, value: object, *, text: bool = False) -> float:
    """``value`` as a float, or a clear error (a bool is refused: it is a flag, not a
    norm)."""
    if isinstance(value, str) and text:
        try:
            return float(value)
        except ValueError:
            raise ValueError(
                f"{name} must be a number or a string of one, such as 'inf' ({name}: {value!r})"
            ) from None
    element = value
    if not isinstance(value, (torch.Tensor, Real)) and hasattr(value, "__array__"):
        try:
            element = torch.as_tensor(value)  # a NumPy array
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a number ({name}: {value!r})") from None
    if isinstance(element, torch.Tensor):
        if element.numel() == 1 and not (element.is_complex() or element.dtype == torch.bool):
            return float(element.item())
        what = f"shape {tuple(element.shape)}, dtype {str(element.dtype).removeprefix('torch.')}"
        raise TypeError(
            f"{name} must be a number, or a tensor or array of one real number ({name}: "
            f"{type(value).__name__} of {what})"
        )
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number ({name}: {value!r})")
    return float(value)


def gradient_norms(
    named: Iterable[tuple[str, nn.Parameter]], norm_type: float, foreach: bool | None
) -> dict[str, tuple[float, str]]:
    """The norm of each gradient of ``named`` parameters (those with a gradient), under the
    parameter's name, with the gradient's dtype (a Python float holds a norm exactly).

    A gradient sharded over a mesh (a DTensor, ``mesh=`` with ``"dp_shard"``) is the
    whole gradient's norm: DTensor's norm of its shards, reduced over the mesh (one
    collective per gradient, in the parameters' order, which every rank of the mesh's
    groups shares)."""
    named = [(name, p) for name, p in named if p.grad is not None]
    norms: dict[str, tuple[float, str]] = {}
    for name, p in named:
        grad = p.grad
        assert grad is not None
        if is_dtensor(grad):
            norm = torch.linalg.vector_norm(grad, norm_type).full_tensor()
        elif foreach is not False and grad.device.type in ("cpu", "cuda"):
            norm = torch._foreach_norm([grad], norm_type)[0]
        else:
            norm = torch.linalg.vector_norm(grad, norm_type)
        norms[name] = (float(norm.item()), str(grad.dtype).removeprefix("torch."))
    return norms


def combine(
    norms: Mapping[str, tuple[float, str]],
    order: Sequence[str],
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """The total norm of the gradients whose ``norms`` are given, combined in ``order``
    (the plain module's), as :func:`torch.nn.utils.get_total_norm` combines them.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the total norm is ``nan`` or infinite.
    """
    parts = [
        torch.tensor(norms[name][0], dtype=getattr(torch, norms[name][1]))
        for name in order
        if name in norms
    ]
    if not parts:
        return torch.tensor(0.0)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(parts), norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(
            f"the total norm of the gradients is not finite (norm_type: {norm_type}, total "
            f"norm: {total.item()}), so they cannot be clipped; pass error_if_nonfinite=False "
            "to scale them by it anyway"
        )
    return total


def clip_by_norms(
    parameters: Iterable[nn.Parameter],
    norms: Mapping[str, tuple[float, str]],
    order: Sequence[str],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` by the total norm of every gradient whose
    ``norms`` are given (see :func:`combine`), as
    :func:`torch.nn.utils.clip_grads_with_norm_` does; the total norm, on the gradients'
    device."""
    parameters = list(parameters)
    total = combine(norms, order, norm_type, error_if_nonfinite)
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        total = total.to(grads[0].device)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total
