"""Integrity of the skip connections of a sequential module.

A layer that keeps a :class:`~gpipe_skip.SkipLayout` of its own (a pipeline keeps the layout
of its partitions) pairs its skips itself, so the check leaves what is inside it alone. This
is the only way a pipeline is recognised here: this package imports no package above it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ._layout import SkipLayout
from ._namespace import SkipKey
from ._skippable import Skippable

__all__ = ["verify_skippables"]


@dataclass
class _Scan:
    """What one pass over the layers found: each key's stashing and popping layer."""

    stashes: dict[SkipKey, int] = field(default_factory=dict)
    pops: dict[SkipKey, int] = field(default_factory=dict)
    problems: list[tuple[int, str]] = field(default_factory=list)


def _describe(index: int, layer: nn.Module) -> str:
    return f"layer {index} ({type(layer).__name__})"


def _skip(key: SkipKey) -> str:
    namespace, name = key
    return f"{name!r} in {namespace!r}"


def _pairs_own_skips(module: nn.Module) -> bool:
    """Whether ``module`` keeps a :class:`SkipLayout` of its own: it pairs its skips itself.

    A pipeline keeps the layout of its partitions (:func:`inspect_skip_layout`), under
    whatever attribute it likes; this package knows no pipeline by name.
    """
    return any(isinstance(value, SkipLayout) for value in vars(module).values())


def scan_layers(layers: Iterable[nn.Module]) -> _Scan:
    """Find every stash and pop of ``layers`` (in order) and every integrity problem."""
    scan = _Scan()
    early_pops: dict[SkipKey, int] = {}
    described: list[str] = []
    for index, layer in enumerate(layers):
        described.append(_describe(index, layer))
        modules = list(layer.named_modules())
        owners = [path for path, module in modules if _pairs_own_skips(module)]
        for path, module in modules:
            if any(not owner or path.startswith(f"{owner}.") for owner in owners):
                continue
            if path and isinstance(module, Skippable):
                scan.problems.append(
                    (
                        index,
                        f"{described[index]} contains a skippable module at {path!r} "
                        f"({type(module).__name__}); skippable modules must be layers of "
                        "the sequential module itself",
                    )
                )
        if not isinstance(layer, Skippable):
            continue
        for key in layer.pop_keys():
            if key in scan.pops:
                first = scan.pops[key]
                scan.problems.append(
                    (index, f"{described[index]} pops {_skip(key)} again (layer {first} pops it)")
                )
                continue
            scan.pops[key] = index
            if key not in scan.stashes:
                early_pops[key] = index
        for key in layer.stash_keys():
            if key in scan.stashes:
                first = scan.stashes[key]
                scan.problems.append(
                    (
                        index,
                        f"{described[index]} stashes {_skip(key)} again (layer {first} stashes it)",
                    )
                )
                continue
            scan.stashes[key] = index
    for key, index in early_pops.items():
        if key in scan.stashes:
            message = f"pops {_skip(key)} before layer {scan.stashes[key]} stashes it"
        else:
            message = f"pops {_skip(key)} but no layer stashes it"
        scan.problems.append((index, f"{described[index]} {message}"))
    for key, index in scan.stashes.items():
        if key not in scan.pops:
            scan.problems.append(
                (index, f"{described[index]} stashes {_skip(key)} but no later layer pops it")
            )
    scan.problems.sort(key=lambda problem: problem[0])
    return scan


def raise_problems(scan: _Scan) -> None:
    """Raise the :class:`TypeError` of :func:`verify_skippables` if ``scan`` found any."""
    if not scan.problems:
        return
    count = len(scan.problems)
    lines = "".join(f"\n  - {message}" for _, message in scan.problems)
    raise TypeError(
        f"the skip connections of the module are inconsistent "
        f"({count} problem{'s' if count > 1 else ''}):{lines}"
    )


def verify_skippables(module: nn.Sequential) -> None:
    """Check that the skippable layers of ``module`` pair up into skip connections.

    In each namespace, every skip name must be stashed by exactly one layer and popped by
    exactly one later layer. Skippable modules must be layers of ``module`` itself, not
    nested in one, but for those of a nested module that keeps a :class:`SkipLayout` of
    its own (as :func:`inspect_skip_layout` gives it), which pairs them itself: a nested
    pipeline such as :class:`~gpipe_core.GPipe`. :class:`~gpipe_core.GPipe` runs the same
    check when it wraps a module.

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Sequential`, or its skip
            connections are inconsistent; the message lists every problem, each naming the
            layer index, the skip name and its namespace.

    Example:
        >>> from gpipe_skip import pop, skippable, stash
        >>> @skippable(stash=["skip"])
        ... class Stash(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("skip", x)
        ...         return x
        >>> @skippable(pop=["skip"])
        ... class Pop(nn.Module):
        ...     def forward(self, x):
        ...         return x + (yield pop("skip"))
        >>> verify_skippables(nn.Sequential(Stash(), Pop()))
        >>> verify_skippables(nn.Sequential(Pop(), Stash(), Stash()))
        Traceback (most recent call last):
          ...
        TypeError: the skip connections of the module are inconsistent (2 problems):
          - layer 0 (Pop) pops 'skip' in <default namespace> before layer 1 stashes it
          - layer 2 (Stash) stashes 'skip' in <default namespace> again (layer 1 stashes it)
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential to verify its skip connections "
            f"(module: {type(module).__name__})"
        )
    raise_problems(scan_layers(layer for layer in module._modules.values() if layer is not None))
