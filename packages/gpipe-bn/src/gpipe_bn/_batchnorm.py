"""A batch normalization layer whose running statistics follow mini-batches, not micro-batches.

In training, :class:`DeferredBatchNorm` normalizes every micro-batch with that micro-batch's
own mean and variance, exactly as :class:`torch.nn.BatchNorm2d` would. What it defers is the
update of ``running_mean``, ``running_var`` and ``num_batches_tracked``: the statistics of the
micro-batches of one mini-batch are merged (count, mean and sum of squared deviations, with the
pairwise formulas of Chan, Golub and LeVeque, which stay accurate however the batch is split)
and the running statistics are updated once, as if the whole mini-batch had gone through an
ordinary batch normalization layer.

The layer learns where a mini-batch ends in one of two ways:

* Inside :func:`mini_batch`, every forward pass in the body is a micro-batch of one mini-batch,
  and the update happens when the body exits (nothing is updated if it raises). GPipe runs
  each of its forward passes in this context, so the number of micro-batches its input splits
  into is always right, uneven or short last chunks included.
* Outside it, the update happens after every :attr:`DeferredBatchNorm.chunks` micro-batches.

Forward passes that re-run a checkpointed function for backward (see
:func:`gpipe_checkpoint.is_recomputing`) are not counted again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe_checkpoint import is_recomputing
from gpipe_microbatch import check_chunks

_Layer = TypeVar("_Layer", bound=nn.Module)

__all__ = ["DeferredBatchNorm", "mini_batch"]

# The input dimensions nn.BatchNorm{1,2,3}d accept.
_INPUT_DIMS = {1: (2, 3), 2: (4,), 3: (5,)}


def _check_dim(dim: object) -> int | None:
    if dim is not None and (isinstance(dim, bool) or dim not in _INPUT_DIMS):
        raise ValueError(f"dim must be 1, 2, 3 or None (dim: {dim!r})")
    return dim


class DeferredBatchNorm(_BatchNorm):
    """Batch normalization that updates its running statistics once per mini-batch.

    Outputs and gradients are those of ``nn.BatchNorm{dim}d`` applied to each micro-batch.
    The running statistics after a mini-batch are those ``nn.BatchNorm{dim}d`` would have
    after that whole mini-batch in one piece: the same ``momentum`` (or cumulative average
    with ``momentum=None``), the same unbiased variance, one more ``num_batches_tracked``.
    In eval mode the running statistics normalize the input, as in ``nn.BatchNorm{dim}d``.
    The parameter and buffer names are those of ``nn.BatchNorm{dim}d``, so state dicts load
    both ways.

    Most users get these layers from :func:`~gpipe_bn.convert_deferred_batch_norm` (or
    ``GPipe(..., deferred_batch_norm=True)``) rather than building them.

    Args:
        num_features: the number of channels ``C`` of an input of shape ``(N, C, ...)``.
        eps: added to the variance for numerical stability.
        momentum: the weight of a mini-batch's statistics in the running statistics, or
            ``None`` for a cumulative average over all mini-batches.
        affine: whether the layer has a learnable scale (``weight``) and shift (``bias``).
        track_running_stats: whether to keep running statistics; without them, eval mode
            normalizes with the batch statistics too, and nothing is deferred.
        device: where the parameters and buffers are created.
        dtype: the floating point type of the parameters and buffers.

    Keyword Args:
        chunks: outside :func:`mini_batch`, how many micro-batches make a mini-batch: the
            running statistics are updated after every ``chunks`` counted micro-batches.
        dim: accept the input shapes of ``nn.BatchNorm{dim}d`` only (``1``: ``(N, C)`` or
            ``(N, C, L)``; ``2``: ``(N, C, H, W)``; ``3``: ``(N, C, D, H, W)``); ``None``
            accepts any input with at least two dimensions.

    Attributes:
        dim (int | None): the ``d`` of the ``nn.BatchNorm{d}d`` whose input shapes are
            accepted, or ``None`` for any input with at least two dimensions.

    Raises:
        ValueError: ``chunks`` is not a positive integer, or ``dim`` is not 1, 2, 3 or None.

    Example:
        Feed the micro-batches of a mini-batch by hand:

        >>> import torch
        >>> bn = DeferredBatchNorm(3, chunks=2, dim=2)
        >>> x = torch.randn(8, 3, 4, 4)
        >>> with mini_batch(bn):
        ...     for micro_batch in x.chunk(2):
        ...         _ = bn(micro_batch)
        >>> reference = torch.nn.BatchNorm2d(3)
        >>> _ = reference(x)
        >>> torch.allclose(bn.running_var, reference.running_var)
        True
        >>> int(bn.num_batches_tracked)
        1
    """

    dim: int | None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        chunks: int = 1,
        dim: int | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.chunks = chunks
        self.dim = _check_dim(dim)
        # How many mini_batch() contexts hold this layer; the outermost one updates.
        self._deferring = 0
        # A layer shared by pipeline partitions is run by several worker threads at once.
        self._lock = threading.Lock()
        self._discard()

    @property
    def chunks(self) -> int:
        """Outside :func:`mini_batch`, the number of micro-batches after which the running
        statistics are updated; may be changed at any time.

        Raises:
            ValueError: set to something that is not a positive integer.
        """
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        self._chunks = check_chunks(chunks)

    # -- what has been accumulated -----------------------------------------------------

    def _discard(self) -> None:
        self._micro_batches = 0
        self._count = 0  # values per channel
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None  # sum of squared deviations from the mean

    @property
    def pending(self) -> int:
        """The number of micro-batches counted since the running statistics were updated."""
        return self._micro_batches

    def discard(self) -> None:
        """Forget the micro-batches counted since the last update of the running statistics.

        Example:
            >>> bn = DeferredBatchNorm(3, chunks=4)
            >>> _ = bn(torch.randn(5, 3))
            >>> bn.pending
            1
            >>> bn.discard()
            >>> bn.pending, int(bn.num_batches_tracked)
            (0, 0)
        """
        self._discard()

    def _accumulate(self, count: int, mean: Tensor, unbiased_var: Tensor) -> None:
        """Merge a micro-batch's statistics (``count`` values per channel) into the sums."""
        assert self.running_mean is not None
        self._micro_batches += 1
        if count == 0:  # an empty micro-batch: counted, with nothing to merge
            return
        # Out of place: the kernel may have saved ``mean`` and ``unbiased_var`` for backward.
        dtype = torch.promote_types(self.running_mean.dtype, torch.float32)
        mean = mean.to(dtype)
        m2 = unbiased_var.to(dtype) * (count - 1)
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = mean, m2
        else:
            total = self._count + count
            delta = mean - self._mean
            self._mean = self._mean + delta * (count / total)
            self._m2 = self._m2 + m2 + delta.square() * (self._count * count / total)
        self._count += count

    def commit(self) -> None:
        """Update the running statistics with the micro-batches counted so far.

        Does nothing if no micro-batch was counted. :func:`mini_batch` calls this when its
        body exits; outside it, the layer calls it after every :attr:`chunks` micro-batches.

        Example:
            >>> bn = DeferredBatchNorm(3, chunks=4)
            >>> _ = bn(torch.randn(5, 3))
            >>> _ = bn(torch.randn(5, 3))
            >>> bn.commit()
            >>> bn.pending, int(bn.num_batches_tracked)
            (0, 1)
        """
        mean, m2, count, micro_batches = self._mean, self._m2, self._count, self._micro_batches
        self._discard()
        if micro_batches == 0 or self.running_mean is None or self.running_var is None:
            return
        # What nn.BatchNorm does for one mini-batch of ``count`` values per channel.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if mean is None or m2 is None:  # empty micro-batches only: the statistics stay
            return
        with torch.no_grad():
            for running, value in (
                (self.running_mean, mean),
                (self.running_var, m2 / (count - 1)),
            ):
                dtype = torch.promote_types(running.dtype, value.dtype)
                value = value.to(running.device, dtype)
                if running.dtype == dtype:
                    running.mul_(1.0 - factor).add_(value, alpha=factor)
                else:  # half buffers: update in the sums' wider dtype
                    updated = running.to(dtype).mul_(1.0 - factor).add_(value, alpha=factor)
                    running.copy_(updated)

    # -- forward -----------------------------------------------------------------------

    def _check_input_dim(self, input: Tensor) -> None:
        if self.dim is None:
            if input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
            return
        dims = _INPUT_DIMS[self.dim]
        if input.dim() not in dims:
            expected = " or ".join(f"{d}D" for d in dims)
            raise ValueError(f"expected {expected} input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input``; in training, count its statistics for the running ones.

        Raises:
            ValueError: ``input`` does not have the dimensions that ``dim`` asks for, or
                (in training) has only one value per channel.
        """
        self._check_input_dim(input)
        running_mean, running_var = self.running_mean, self.running_var
        if not self.training:
            use_batch_stats = running_mean is None and running_var is None
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias,
                use_batch_stats, 0.0, self.eps,
            )  # fmt: skip
        if not self.track_running_stats or running_mean is None or running_var is None:
            return F.batch_norm(
                input, None, None, self.weight, self.bias, True, 0.0, self.eps
            )  # fmt: skip

        # Let the kernel compute the micro-batch's mean and unbiased variance, exactly as
        # for nn.BatchNorm: with momentum 1 it writes them into these fresh tensors. The
        # recomputation takes the same path, so its output is bitwise the first one.
        mean, unbiased_var = running_mean.new_zeros((2, self.num_features)).unbind()
        output = F.batch_norm(
            input, mean, unbiased_var, self.weight, self.bias, True, 1.0, self.eps
        )  # fmt: skip
        if not is_recomputing():
            with self._lock, torch.no_grad():
                self._accumulate(input.numel() // input.size(1), mean, unbiased_var)
                if self._deferring == 0 and self._micro_batches >= self.chunks:
                    self.commit()
        return output

    def extra_repr(self) -> str:
        base: str = super().extra_repr()  # type: ignore[no-untyped-call]
        return f"{base}, chunks={self.chunks}, dim={self.dim}"

    # -- copies ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # A copy starts with nothing pending, in no mini_batch() context, with its own lock.
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        state = dict(state)
        state.update(_deferring=0, _micro_batches=0, _count=0, _mean=None, _m2=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()


@contextmanager
def mini_batch(module: nn.Module) -> Iterator[None]:
    """Count the forward passes in the body as the micro-batches of one mini-batch.

    Every :class:`DeferredBatchNorm` in ``module`` (``module`` itself included) accumulates
    the statistics of the micro-batches it sees in the body, however many there are, and
    updates its running statistics once when the body exits. If the body raises, the
    statistics of the unfinished mini-batch are dropped and the running statistics stay as
    they were. Micro-batches counted before the body and not yet committed are dropped when
    the body starts: it is a new mini-batch.

    Contexts nest: only the outermost one that holds a layer updates it, so a mini-batch can
    span several calls of a model that opens its own context (``GPipe`` does).

    Args:
        module: the model, or a single layer.

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Module`.
        ValueError: one :class:`DeferredBatchNorm` is used at several places of ``module``.

    Example:
        Gradient accumulation over micro-batches, with the statistics of the whole batch:

        >>> from gpipe_bn import convert_deferred_batch_norm
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> model = convert_deferred_batch_norm(model)
        >>> x = torch.randn(6, 4)
        >>> with mini_batch(model):
        ...     for micro_batch in x.chunk(4):  # 3 micro-batches of 2
        ...         model(micro_batch).sum().backward()
        >>> int(model[1].num_batches_tracked)
        1
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (module: {type(module).__name__})")
    layers = list(dict.fromkeys(batch_norm_places(module, DeferredBatchNorm)))
    for layer in layers:
        if layer._deferring == 0:
            layer._discard()
        layer._deferring += 1
    completed = False
    try:
        yield
        completed = True
    finally:
        # Release every layer before updating any: an update that raises must not leave
        # the others held by this context.
        for layer in layers:
            layer._deferring -= 1
        for layer in layers:
            if layer._deferring == 0:
                if completed:
                    layer.commit()
                else:
                    layer._discard()


def batch_norm_places(module: nn.Module, kind: type[_Layer]) -> list[_Layer]:
    """The layers of ``module`` of type ``kind``, refusing one used at several places.

    A batch norm layer used at two places of a model updates its running statistics twice
    per mini-batch without micro-batches (``num_batches_tracked`` counts 2), once with the
    statistics at each place; deferred, its statistics would be pooled over both places
    and counted once. So such a layer is refused rather than tracked otherwise.

    Raises:
        ValueError: a layer of type ``kind`` is used at several places.
    """
    places: dict[int, list[str]] = {}
    layers: list[_Layer] = []
    for name, layer in module.named_modules(remove_duplicate=False):
        if isinstance(layer, kind):
            places.setdefault(id(layer), []).append(name or "<module>")
            layers.append(layer)
    for names in places.values():
        if len(names) > 1:
            raise ValueError(
                "a batch norm layer used at several places cannot defer its running "
                "statistics: nn.BatchNorm updates them once per place, deferred they would "
                f"be pooled and counted once; give each place a layer of its own (places: {names})"
            )
    return layers
