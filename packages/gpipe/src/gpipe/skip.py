"""Skip connections: ``gpipe.skip`` re-exports the user API of :mod:`gpipe_skip`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe import GPipe
    >>> from gpipe.skip import pop, skippable, stash
    >>> @skippable(stash=["skip"])
    ... class Save(nn.Module):
    ...     def forward(self, x):
    ...         yield stash("skip", x)
    ...         return x * 2
    >>> @skippable(pop=["skip"])
    ... class Add(nn.Module):
    ...     def forward(self, x):
    ...         return x + (yield pop("skip"))
    >>> model = GPipe(nn.Sequential(Save(), nn.Identity(), Add()), balance=[1, 1, 1])
    >>> model(torch.ones(2).to(model.devices[0]))
    tensor([3., 3.])
"""

from gpipe_skip import (
    Namespace,
    SkipLayout,
    Skippable,
    SkipRoute,
    SkipTracker,
    inspect_skip_layout,
    pop,
    run_partition,
    skippable,
    stash,
    use_skip_tracker,
    verify_skippables,
)

__all__ = [
    "Namespace",
    "SkipLayout",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "inspect_skip_layout",
    "pop",
    "run_partition",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]
