"""Stand-ins: shallow copies of a model's modules with some of their submodules replaced,
so that the family's own ``forward`` runs around other layers than its own, and the
copies a pipeline's pieces hold a model's modules in. The model itself is never changed.

Paths are dotted, from the module given (``model.decoder.layers``); ``""`` is the module
itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

__all__ = ["only", "stand_in", "stand_ins", "without"]


def stand_in(module: nn.Module, training: bool, **children: object) -> nn.Module:
    """A shallow copy of ``module`` whose children named in ``children`` are replaced (by
    any callables), in ``training`` mode; ``module`` is not changed."""
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.__dict__["_modules"] = {**module._modules, **children}
    copy.__dict__["training"] = training
    return copy


def stand_ins(
    root: nn.Module, training: bool, replaced: Mapping[str, object]
) -> dict[str, nn.Module]:
    """Stand-ins of ``root`` and of every module on the way to each path of ``replaced``,
    the module at each path replaced by its value: the stand-ins by their paths (``""``:
    the root's)."""
    made: dict[str, nn.Module] = {}

    def build(module: nn.Module, path: str) -> nn.Module:
        prefix = f"{path}." if path else ""
        children: dict[str, object] = {}
        for name, child in module._modules.items():
            inner = prefix + name
            if inner in replaced:
                children[name] = replaced[inner]
            elif child is not None and any(p.startswith(f"{inner}.") for p in replaced):
                children[name] = build(child, inner)
        made[path] = stand_in(module, training, **children)
        return made[path]

    build(root, "")
    return made


def _below(paths: Iterable[str], name: str) -> list[str]:
    """The paths under the child ``name``, relative to it (``""``: the child itself)."""
    found = []
    for path in paths:
        head, _, rest = path.partition(".")
        if head == name:
            found.append(rest)
    return found


def without(module: nn.Module, paths: Iterable[str]) -> nn.Module:
    """``module`` without the submodules at ``paths`` (relative to it): the modules on the
    way to them are shallow copies holding their other children (and their own tensors,
    the same objects), every other module is the model's own."""
    paths = list(paths)
    if not paths:
        return module
    children: dict[str, nn.Module | None] = {}
    for name, child in module._modules.items():
        inner = _below(paths, name)
        if "" in inner:
            continue
        children[name] = without(child, inner) if inner and child is not None else child
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.__dict__["_modules"] = children
    return copy


def only(module: nn.Module, paths: Iterable[str]) -> nn.Module:
    """The submodules of ``module`` at ``paths`` (relative to it) and nothing else: the
    modules on the way to them are shallow copies holding no tensor of their own and only
    the children on the way; the modules at ``paths`` are the model's own."""
    paths = list(paths)
    if "" in paths:
        return module
    children: dict[str, nn.Module | None] = {}
    for name, child in module._modules.items():
        inner = _below(paths, name)
        if inner and child is not None:
            children[name] = only(child, inner)
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.__dict__.update(_modules=children, _parameters={}, _buffers={})
    copy.__dict__["_non_persistent_buffers_set"] = set()
    return copy
