"""Layers built on the meta device, made on their partition's device and initialised, or
refused: never left holding uninitialised memory.

A rank of a large pipeline builds its model on the meta device and keeps its own layers
only (see :doc:`/distributed`). Those layers are made on their devices with
:meth:`~torch.nn.Module.to_empty`, which allocates memory and does not initialise it: what
no initialiser then writes keeps whatever the memory held (NaN, ``4.6e-41``, ``15849.9``),
and training goes wrong silently. So every tensor :func:`materialize` allocates is first
filled with a value that no initialiser leaves everywhere, the layers are initialised, and
a tensor that still holds the fill value everywhere is refused, by name.

**The fill value.** Floating-point and complex tensors are filled with NaN: no initialiser
sets a whole tensor to NaN, and a tensor that is NaN everywhere is unusable anyway.
Integer and boolean tensors have no such value (a step counter may be 0, a mask all
``True``), so they are filled with their dtype's largest value (``True`` for a boolean)
and judged by their version counter too: one still at its fill value everywhere *and*
never written in place since (same tensor, same :attr:`~torch.Tensor._version`) is
uninitialised; an initialiser that wrote it (``zero_()``, ``copy_``, a state dict's load)
or replaced it is not. Empty tensors have nothing to initialise. What is checked is the
whole tensor: an initialiser that sets part of a tensor and leaves NaN in the rest is not
seen (use ``torch.isnan`` in a test of your initialiser).

**Initialisation**, for each layer of this rank that holds a tensor on the meta device:

1. the layer is made on its partition's device (:meth:`~torch.nn.Module.to_empty`; its
   tensors that were not on meta are kept, and a meta tensor held in several places, tied,
   is made once for all of them) and the new tensors are filled;
2. ``reset_parameters()`` of each of its modules that has one, and that holds a tensor
   that came from meta (inner modules before the modules that hold them, as
   constructors run);
3. each entry of ``GPipe(..., init=...)``, in order: a callable is called on the layer
   (under :func:`torch.no_grad`); a state dict (a mapping of the plain model's keys,
   ``"3.norm.weight"``) is loaded into it, the keys of the layer's tensors only;
4. the check: a tensor still at its fill value is refused with a :class:`ValueError`
   naming the layer (``module[3]``), the tensor (``3.norm.weight``) and what to do. A
   non-persistent buffer (RoPE's ``inv_freq``, computed in the constructor) is in no state
   dict, so loading a checkpoint cannot set it: an ``init`` callable must compute it as
   the constructor does.

On a refusal (or any error while initialising), the layers made here go back to the meta
device, so that the module is as it was and a retry with ``init=`` starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias, cast

import torch
from torch import Tensor, nn

from ._state_dict import Renaming, shown

__all__ = ["Init", "InitStep", "Materializer", "check_init"]

#: One way to initialise a layer made from the meta device: a callable called on the layer,
#: or a state dict (the plain model's keys) loaded into it.
InitStep: TypeAlias = Callable[[nn.Module], object] | Mapping[str, Tensor]
#: What ``GPipe(..., init=...)`` takes: one step, or several applied in order.
Init: TypeAlias = InitStep | Sequence[InitStep] | None

#: How many uninitialised tensors a refusal names.
_SHOWN = 8


def _layer_name(name: str) -> str:
    """How errors name a layer of the plain model: ``module[3]``, ``module.embed``."""
    return f"module[{name}]" if name.isdigit() else f"module.{name}"


def check_init(init: object, layer_names: Sequence[str]) -> tuple[InitStep, ...]:
    """Check ``GPipe``'s ``init`` for a module whose layers are ``layer_names``; its steps.

    Raises:
        TypeError: ``init`` is not a callable, a state dict (a mapping of string keys to
            tensors), a list or tuple of them, or None.
        ValueError: a state dict holds a key of no layer of the module.
    """
    steps = list(init) if isinstance(init, (list, tuple)) else [] if init is None else [init]
    names = set(layer_names)
    for index, step in enumerate(steps):
        where = f"init[{index}]" if isinstance(init, (list, tuple)) else "init"
        if isinstance(step, Mapping):
            bad = [k for k, v in step.items() if not isinstance(k, str) or not torch.is_tensor(v)]
            if bad:
                raise TypeError(
                    f"{where} as a state dict maps the plain model's keys to tensors "
                    f"({where}[{bad[0]!r}]: {type(step[bad[0]]).__name__})"
                )
            unknown = [key for key in step if key.partition(".")[0] not in names]
            if unknown:
                raise ValueError(
                    f"{where} holds keys of no layer of the module: a state dict for init has "
                    "the plain model's keys, such as '0.weight' (the keys of "
                    f"module.state_dict()) ({where} keys: {unknown[:_SHOWN]}, layers: "
                    f"{list(layer_names)[:_SHOWN]})"
                )
        elif not callable(step):
            raise TypeError(
                f"{where} must be a callable called on each layer made from the meta device, "
                "a state dict of the plain model's keys, a list of them, or None "
                f"({where}: {type(step).__name__})"
            )
    return tuple(cast(list[InitStep], steps))


def _tensors(layer: nn.Module) -> dict[str, Tensor]:
    """The layer's parameters and buffers by key (a tensor held twice, once)."""
    found: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, tensor in (*layer.named_parameters(), *layer.named_buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found[key] = tensor
    return found


def _fill(tensor: Tensor) -> bool | int | float:
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    if tensor.dtype == torch.bool:
        return True
    return int(torch.iinfo(tensor.dtype).max)


#: Where a module holds a tensor: the module, ``"_parameters"`` or ``"_buffers"``, the name.
_Slot = tuple[nn.Module, str, str]


def _slots(layer: nn.Module) -> list[tuple[_Slot, Tensor]]:
    """Every place ``layer``'s modules hold a tensor, with the tensor (a tensor held in
    several places, tied, once per place)."""
    found: list[tuple[_Slot, Tensor]] = []
    for module in layer.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    found.append(((module, kind, name), tensor))
    return found


class _Made:
    """One layer made from meta here: its filled tensors, by key, with the identity and
    version counter of each integer one after the fill.

    The layer is made with :meth:`~torch.nn.Module.to_empty`, which gives every place a
    tensor is held a new tensor; then each place gets back its tensor that was not on meta,
    and a meta tensor held in several places (tied weights, in this layer or one made
    before: ``made``) one new tensor, so that ties hold as they do for a model built on
    a device. Then the layer moves to ``device``, as layers not from meta do.
    """

    def __init__(
        self,
        name: str,
        layer: nn.Module,
        device: torch.device,
        made: dict[int, tuple[Tensor, Tensor]],
        renaming: Renaming | None = None,
    ) -> None:
        self.name, self.layer, self.renaming = name, layer, renaming
        self.before = _slots(layer)
        layer.to_empty(device=device)
        fresh: set[int] = set()
        for (module, kind, slot), original in self.before:
            holder = getattr(module, kind)
            if not original.is_meta:
                holder[slot] = original
            elif id(original) in made:
                holder[slot] = made[id(original)][1]
            else:
                made[id(original)] = (original, holder[slot])
                fresh.add(id(holder[slot]))
        layer.to(device)
        after = _tensors(layer)
        self.keys = [key for key, tensor in after.items() if id(tensor) in fresh]
        self.versions: dict[str, tuple[int, int]] = {}
        with torch.no_grad():
            for key in self.keys:
                tensor = after[key]
                tensor.fill_(_fill(tensor))
                self.versions[key] = (id(tensor), tensor._version)

    def revert(self) -> None:
        """Every place of the layer back to the tensor it held (on meta, for those made)."""
        for (module, kind, slot), original in self.before:
            getattr(module, kind)[slot] = original

    def reset(self) -> None:
        """``reset_parameters()`` of each module holding a tensor that came from meta,
        inner modules first."""
        owners = {""}
        for key in self.keys:
            parts = key.split(".")[:-1]
            owners.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
        for path, module in reversed(list(self.layer.named_modules())):
            reset = getattr(module, "reset_parameters", None)
            if path in owners and callable(reset):
                reset()

    def apply(self, steps: Sequence[InitStep]) -> None:
        for step in steps:
            if isinstance(step, Mapping):
                prefix = f"{self.name}."
                mine = {k[len(prefix) :]: v for k, v in step.items() if k.startswith(prefix)}
                result = self.layer.load_state_dict(mine, strict=False)
                if result.unexpected_keys:
                    renaming = self.renaming
                    unexpected = [shown(prefix + key, renaming) for key in result.unexpected_keys]
                    layer = f"{_layer_name(self.name)} ({type(self.layer).__name__})"
                    if self.renaming is not None:
                        layer = "the model"
                    raise ValueError(
                        f"init's state dict holds keys that {layer} does not have, or "
                        "cannot load (a non-persistent buffer is in no state dict) "
                        f"(keys: {unexpected[:_SHOWN]})"
                    )
            else:
                with torch.no_grad():
                    step(self.layer)

    def uninitialised(self) -> list[str]:
        """The keys whose tensors still hold the fill value everywhere, described."""
        now = _tensors(self.layer)
        left = []
        for key in self.keys:
            tensor = now.get(key)
            if tensor is None or tensor.numel() == 0 or tensor.is_meta:
                continue
            fill = _fill(tensor)
            if isinstance(fill, float):
                untouched = bool(torch.isnan(tensor).all())
            else:
                untouched = self.versions[key] == (id(tensor), tensor._version) and bool(
                    (tensor == fill).all()
                )
            if untouched:
                left.append(self._describe(key))
        return left

    def _describe(self, key: str) -> str:
        path, _, leaf = key.rpartition(".")
        owner = self.layer.get_submodule(path)
        kind = type(owner).__name__
        full = shown(f"{self.name}.{key}", self.renaming)
        if leaf in owner._parameters:
            has = "has" if callable(getattr(owner, "reset_parameters", None)) else "has no"
            return f"{full}, a parameter of {kind}, which {has} reset_parameters()"
        if leaf in owner._non_persistent_buffers_set:
            return (
                f"{full}, a non-persistent buffer of {kind}, which no state dict holds: "
                "compute it in init as the constructor does"
            )
        return f"{full}, a buffer of {kind}"


class Materializer:
    """Makes the partitions' layers on their devices, one partition after the other
    (:meth:`place`), those built on the meta device initialised by ``steps`` as the module
    docstring says; then refuses what is left uninitialised (:meth:`check`), or puts the
    layers made back on meta (:meth:`revert`). With a ``renaming`` (a model's own names for
    the plain keys), errors name the tensors by those names."""

    def __init__(self, steps: Sequence[InitStep], renaming: Renaming | None = None) -> None:
        self.steps = steps
        self.renaming = renaming
        self.layers: list[_Made] = []
        #: Each meta tensor made here, by id: the meta tensor (kept alive) and its new one.
        self.made: dict[int, tuple[Tensor, Tensor]] = {}
        self.left: list[tuple[int, list[str]]] = []

    def place(self, index: int, partition: nn.Sequential, device: torch.device) -> None:
        """Make partition ``index``'s layers on ``device``: those built on the meta device
        initialised, the others moved.

        Raises:
            ValueError: a state dict in the steps holds keys a layer cannot load.
        """
        layers: list[_Made] = []
        for name, layer in partition._modules.items():
            assert layer is not None
            if any(tensor.is_meta for _, tensor in _slots(layer)):
                layers.append(_Made(name, layer, device, self.made, self.renaming))
                self.layers.append(layers[-1])
            else:
                layer.to(device)
        for entry in layers:
            entry.reset()
            entry.apply(self.steps)
        left = [
            key
            if self.renaming is not None
            else f"{_layer_name(entry.name)} ({type(entry.layer).__name__}): {key}"
            for entry in layers
            for key in entry.uninitialised()
        ]
        self.left.append((index, left))

    def revert(self) -> None:
        """Put the layers made back as they were, on the meta device."""
        for entry in reversed(self.layers):
            entry.revert()
        self.layers.clear()
        self.made.clear()

    def check(self) -> None:
        """Refuse the tensors left uninitialised in the partitions placed, if any.

        Raises:
            ValueError: naming the layers and tensors, and what to do.
        """
        left = [key for _, keys in sorted(self.left) for key in keys]
        if not left:
            return
        listed = "; ".join(left[:_SHOWN])
        if len(left) > _SHOWN:
            listed += f"; and {len(left) - _SHOWN} more"
        raise ValueError(
            "layers built on the meta device were left with uninitialised tensors, which "
            "would train on whatever memory held (NaN or garbage): give each module a "
            "reset_parameters(), or pass GPipe(..., init=...) a function called on each "
            "layer made from meta that sets them, and/or a state dict of the plain model's "
            f"keys (see 'Large models: build only your own layers' in the docs) ({listed})"
        )
