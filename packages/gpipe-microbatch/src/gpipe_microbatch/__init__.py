"""Micro-batches, their checks, and the few pieces the packages above share.

Most users never import this package: :class:`~gpipe_core.GPipe` uses it. These are its
building blocks:

* Micro-batches: :class:`Batch`, :func:`scatter` and :func:`gather` split a mini-batch
  into micro-batches and put them back together; :class:`NoChunk` marks a tensor every
  micro-batch gets whole; :func:`check`, :func:`check_output` and :func:`check_chunks`
  check what a user passes and what a layer returns; :func:`make_tuple` puts a tuple of
  any type (a namedtuple) back together from its values, and :func:`make_value` a tuple or
  a mapping (a ``dict``, a ``ModelOutput``), whose type and keys a :class:`MappingContainer`
  (a batch's :data:`Container`) keeps; :func:`values_of` and :func:`with_values` take a
  mini-batch's values out of a tuple or a mapping and put others back in its place.
* The checks of a split: :func:`check_module`, :func:`check_balance` and
  :exc:`BalanceError`, shared by the balancing tools and the pipeline.
* Devices as users name them, shared by the balancing tools and the pipeline:
  :data:`Device`, :func:`normalize_device` and :func:`use_device` (a no-op but on CUDA).
* What the checkpoint and the pipeline both carry a micro-batch's work with:
  :func:`get_phony` gives an empty tensor that carries an edge in autograd, and
  :class:`ThreadState` carries grad mode, autocast and saved-tensor hooks into worker
  threads and recomputations.

Streams, device copies and fork/join ordering are gpipe-core's, their only user.

Example:
    >>> import torch
    >>> from gpipe_microbatch import gather, scatter
    >>> batches = scatter(torch.arange(10.0), chunks=4)
    >>> [len(b.tensor) for b in batches]
    [3, 3, 3, 1]
    >>> gather(batches).shape
    torch.Size([10])
"""

from .__about__ import __version__
from ._balance import BalanceError, check_balance, check_module
from ._batch import Batch
from ._checks import check, check_chunks, check_output
from ._device import Device, normalize_device, use_device
from ._mapping import MappingContainer, mapping_container
from ._nochunk import NoChunk
from ._phony import get_phony
from ._renamed import deprecated_aliases
from ._scatter import gather, scatter
from ._threadstate import ThreadState
from ._values import (
    Container,
    TensorOrTensors,
    labels,
    make_tuple,
    make_value,
    values_of,
    with_values,
)

__all__ = [
    "BalanceError",
    "Batch",
    "Container",
    "Device",
    "MappingContainer",
    "NoChunk",
    "TensorOrTensors",
    "ThreadState",
    "__version__",
    "check",
    "check_balance",
    "check_chunks",
    "check_module",
    "check_output",
    "deprecated_aliases",
    "gather",
    "get_phony",
    "labels",
    "make_tuple",
    "make_value",
    "mapping_container",
    "normalize_device",
    "scatter",
    "use_device",
    "values_of",
    "with_values",
]

#: Old names, kept as deprecated aliases of the new ones; not in ``__all__``. A batch's
#: container was called its kind, a word kept for an action's kind.
_RENAMED = {
    "Kind": "Container",
    "MappingKind": "MappingContainer",
    "mapping_kind": "mapping_container",
}


__getattr__ = deprecated_aliases(__name__, _RENAMED, globals())
