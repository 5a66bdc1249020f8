"""Skip connections for sequential models, carried straight to the layer that needs them.

* :func:`skippable`, :func:`stash`, :func:`pop`: layers whose generator ``forward`` stashes
  a tensor for a later layer, or pops one an earlier layer stashed.
* :class:`Namespace` and :meth:`Skippable.isolate`: one skip name used by several pairs.
* :func:`verify_skippables`: every stash has its pop, and the other way round.
* :func:`inspect_skip_layout`: which skips cross which partitions of a split model.
* :class:`SkipTracker`, :func:`use_skip_tracker`, :func:`run_partition`: where stashed
  tensors wait, for pipelines and profilers.

Skippable layers work in a plain :class:`torch.nn.Sequential`; :class:`~gpipe_core.GPipe`
sends each skip tensor from the partition that stashes it straight to the one that pops it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe_skip import pop, skippable, stash
    >>> @skippable(stash=["skip"])
    ... class Save(nn.Module):
    ...     def forward(self, x):
    ...         yield stash("skip", x)
    ...         return x * 10
    >>> @skippable(pop=["skip"])
    ... class Add(nn.Module):
    ...     def forward(self, x):
    ...         skip = yield pop("skip")
    ...         return x + skip
    >>> nn.Sequential(Save(), nn.Identity(), Add())(torch.ones(2))
    tensor([11., 11.])
"""

from .__about__ import __version__
from ._inspect import inspect_skip_layout
from ._layout import SkipLayout, SkipRoute
from ._namespace import DEFAULT_NAMESPACE, Namespace, SkipKey
from ._skippable import Pop, Skippable, Stash, pop, skippable, stash
from ._tracker import SkipTracker, current_skip_tracker, run_partition, use_skip_tracker
from ._verify import verify_skippables

__all__ = [
    "DEFAULT_NAMESPACE",
    "Namespace",
    "Pop",
    "SkipKey",
    "SkipLayout",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "Stash",
    "__version__",
    "current_skip_tracker",
    "inspect_skip_layout",
    "pop",
    "run_partition",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]
