"""Deferred batch normalization: running statistics per mini-batch, not per micro-batch.

* :class:`DeferredBatchNorm`: normalizes each micro-batch like ``nn.BatchNorm{1,2,3}d`` and
  updates the running statistics once per mini-batch, as the whole mini-batch would.
* :func:`convert_deferred_batch_norm`: replaces the batch normalization layers of a model;
  :func:`convert_plain_batch_norm` gives the model back with plain ones.
* :func:`mini_batch`: the forward passes in its body are the micro-batches of one mini-batch.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe_bn import convert_deferred_batch_norm, mini_batch
    >>> model = convert_deferred_batch_norm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    >>> with mini_batch(model):
    ...     for micro_batch in torch.randn(8, 4).chunk(4):
    ...         model(micro_batch).sum().backward()
    >>> int(model[1].num_batches_tracked)
    1
"""

from .__about__ import __version__
from ._batchnorm import DeferredBatchNorm, mini_batch
from ._convert import convert_deferred_batch_norm, convert_plain_batch_norm

__all__ = [
    "DeferredBatchNorm",
    "__version__",
    "convert_deferred_batch_norm",
    "convert_plain_batch_norm",
    "mini_batch",
]
