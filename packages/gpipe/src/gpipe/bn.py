"""Deferred batch normalization, from the gpipe-bn distribution.

``GPipe(..., deferred_batch_norm=True)`` uses these; import them to convert a model or feed
micro-batches by hand. Each name is the object of :mod:`gpipe_bn`, documented there.

Example:
    >>> from torch import nn
    >>> from gpipe.bn import DeferredBatchNorm, convert_deferred_batch_norm
    >>> model = convert_deferred_batch_norm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    >>> isinstance(model[1], DeferredBatchNorm)
    True
"""

from gpipe_bn import (
    DeferredBatchNorm,
    convert_deferred_batch_norm,
    convert_plain_batch_norm,
    mini_batch,
)

__all__ = [
    "DeferredBatchNorm",
    "convert_deferred_batch_norm",
    "convert_plain_batch_norm",
    "mini_batch",
]
