"""Replace the batch normalization layers of a model with :class:`DeferredBatchNorm`, and back."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from gpipe_microbatch import check_chunks

from ._batchnorm import DeferredBatchNorm, batch_norm_places

__all__ = ["convert_deferred_batch_norm", "convert_plain_batch_norm"]

# What an nn.BatchNorm{1,2,3}d holds (None where it has no affine or running statistics).
_PARAMETERS = {"weight", "bias"}
_BUFFERS = {"running_mean", "running_var", "num_batches_tracked"}
_DIMS: tuple[tuple[type[_BatchNorm], int], ...] = (
    (nn.BatchNorm1d, 1),
    (nn.BatchNorm2d, 2),
    (nn.BatchNorm3d, 3),
)


def _kind_of(module: nn.Module) -> tuple[_BatchNorm, int] | None:
    """``module`` and its ``d`` if it is an ``nn.BatchNorm{d}d``."""
    # nn.LazyBatchNorm2d becomes an nn.BatchNorm2d in its first forward pass.
    lazy = isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()
    if lazy and any(getattr(module, "cls_to_become", None) is kind for kind, _ in _DIMS):
        raise ValueError(
            "a lazy batch norm layer cannot be converted before its first forward pass "
            f"(module: {type(module).__name__})"
        )
    for kind, dim in _DIMS:
        if isinstance(module, kind):
            _check_plain(module)
            return module, dim
    return None


def _check_plain(module: _BatchNorm) -> None:
    """Refuse a layer holding what the new layer would not keep: a weight reparametrized
    (``torch.nn.utils.parametrize``, ``weight_norm``, ``spectral_norm``) or extra tensors."""
    parameters, buffers = list(module._parameters), list(module._buffers)
    modules = list(module._modules)
    if set(parameters) != _PARAMETERS or set(buffers) != _BUFFERS or modules:
        raise ValueError(
            "a batch norm layer with a reparametrized weight or tensors of its own cannot "
            f"be converted (module: {type(module).__name__}, parameters: {parameters}, "
            f"buffers: {buffers}, modules: {modules})"
        )


def _deferred(module: _BatchNorm, dim: int, chunks: int) -> DeferredBatchNorm:
    """A :class:`DeferredBatchNorm` holding ``module``'s parameters and buffers."""
    layer = DeferredBatchNorm(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
        device="meta",  # replaced below, without allocating
        chunks=chunks,
        dim=dim,
    )
    _take_tensors(layer, module)
    return layer


def _take_tensors(layer: _BatchNorm, module: _BatchNorm) -> None:
    """Give ``layer`` ``module``'s parameters and buffers, and its training mode.

    The same tensors: parameters stay leaves with their requires_grad, optimizers that hold
    them keep working, and device and dtype are those of the original.
    """
    for name in ("weight", "bias"):
        layer._parameters[name] = module._parameters.get(name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        layer._buffers[name] = module._buffers.get(name)
    layer._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    layer.train(module.training)


def convert_deferred_batch_norm(module: nn.Module, chunks: int = 1) -> nn.Module:
    """Replace every ``nn.BatchNorm1d``, ``nn.BatchNorm2d`` and ``nn.BatchNorm3d`` in ``module``.

    Each batch normalization layer (subclasses included) is replaced by a
    :class:`DeferredBatchNorm` that holds the same parameter and buffer tensors, so weights,
    running statistics, device, dtype, ``requires_grad`` and the training mode are kept, and
    that accepts the same input shapes. A layer used at several places is refused: deferred,
    its statistics could not be those of each place. Other layers (``nn.SyncBatchNorm``,
    layers already deferred) are left as they are. Hooks registered on a replaced layer are
    not carried over.

    The tree is changed in place (not at all if an error is raised); the return value is
    ``module``, or its replacement when ``module`` is itself a batch normalization layer.

    Args:
        module: the model.
        chunks: the number of micro-batches in a mini-batch, for layers used outside
            :func:`~gpipe_bn.mini_batch` (see :class:`DeferredBatchNorm`).

    Returns:
        The converted model.

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Module`.
        ValueError: ``chunks`` is not a positive integer, a lazy batch normalization
            layer has not been initialized by a first forward pass yet, or a batch
            normalization layer holds tensors the new layer would not keep (a weight
            reparametrized by :mod:`torch.nn.utils.parametrize`, ``weight_norm`` or
            ``spectral_norm``, or tensors of a subclass), or a batch normalization layer is
            used at several places.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> model = convert_deferred_batch_norm(model, chunks=4)
        >>> type(model[1]).__name__, model[1].chunks, model[1].dim
        ('DeferredBatchNorm', 4, 2)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (module: {type(module).__name__})")
    chunks = check_chunks(chunks)
    batch_norm_places(module, _BatchNorm)  # refuse before replacing anything
    for node in module.modules():
        _kind_of(node)
    replaced: dict[int, nn.Module] = {}

    def convert(node: nn.Module) -> nn.Module:
        if id(node) in replaced:
            return replaced[id(node)]
        kind = _kind_of(node)
        new = node if kind is None else _deferred(*kind, chunks)
        replaced[id(node)] = new
        if kind is None:
            for name, child in list(node._modules.items()):
                if child is not None:
                    node._modules[name] = convert(child)
        return new

    return convert(module)


class _BatchNormAnyDim(_BatchNorm):
    """Plain batch normalization of any input with at least two dimensions (what a
    :class:`DeferredBatchNorm` with ``dim=None`` accepts)."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input with at least 2 dimensions (got {input.dim()}D)")


def _plain(layer: DeferredBatchNorm) -> _BatchNorm:
    """The ``nn.BatchNorm{d}d`` holding ``layer``'s parameters and buffers."""
    kind = {dim: kind for kind, dim in _DIMS}.get(layer.dim or 0, _BatchNormAnyDim)
    plain = kind(
        layer.num_features,
        layer.eps,
        layer.momentum,
        layer.affine,
        layer.track_running_stats,
        device="meta",  # replaced below, without allocating
    )
    _take_tensors(plain, layer)
    return plain


def convert_plain_batch_norm(module: nn.Module) -> nn.Module:
    """``module`` with every :class:`DeferredBatchNorm` as a plain batch normalization layer.

    The converse of :func:`convert_deferred_batch_norm`, without changing ``module``: each
    deferred layer is replaced by a new ``nn.BatchNorm{dim}d`` (``dim=None``: a plain batch
    norm of any input with at least two dimensions) holding the **same** parameter and
    buffer tensors, so it has the running statistics the deferred layer has committed, and
    training it trains the deferred layer's parameters and updates its running statistics
    (once per call, as ``nn.BatchNorm`` does). Statistics of micro-batches not committed
    yet (outside :func:`~gpipe_bn.mini_batch`) are not carried. Every module on the way to
    a deferred layer is a shallow copy (its own dictionary of submodules); the others are
    the module's own. ``copy.deepcopy`` of the result is a model of its own.

    Args:
        module: the model.

    Returns:
        The model with plain batch normalization layers (``module`` itself when it holds
        no deferred layer).

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Module`.

    Example:
        >>> from torch import nn
        >>> deferred = convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(4)), chunks=2)
        >>> plain = convert_plain_batch_norm(deferred)
        >>> type(plain[0]).__name__, type(deferred[0]).__name__
        ('BatchNorm1d', 'DeferredBatchNorm')
        >>> plain[0].weight is deferred[0].weight
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (module: {type(module).__name__})")
    converted: dict[int, nn.Module] = {}

    def convert(node: nn.Module) -> nn.Module:
        if id(node) in converted:
            return converted[id(node)]
        new: nn.Module = node
        if isinstance(node, DeferredBatchNorm):
            new = _plain(node)
        else:
            children = {
                name: convert(child) for name, child in node._modules.items() if child is not None
            }
            if any(child is not node._modules[name] for name, child in children.items()):
                new = _shallow_copy(node)
                new._modules.update(children)
        converted[id(node)] = new
        return new

    return convert(module)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A module of ``module``'s class sharing its attributes, with a dictionary of
    submodules of its own."""
    copy: nn.Module = object.__new__(type(module))
    state: dict[str, Any] = dict(module.__dict__)
    state["_modules"] = dict(module._modules)
    copy.__dict__.update(state)
    return copy
