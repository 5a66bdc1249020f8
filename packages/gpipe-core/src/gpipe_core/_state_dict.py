"""State-dict keys: a module that holds layers under other names gives the plain keys.

A :class:`~gpipe_core.GPipe` holds the layer ``3`` of its module as ``partitions.1.3``, and
a :class:`~gpipe_core.WithDevice` holds its layer as ``module``. Both save and load under
the keys of the module without them (``3.weight``), so that a checkpoint moves between
balances, ranks and the plain :class:`~torch.nn.Sequential`. One mechanism does it for
both: a :class:`KeyMap` says how a key inside the module (after its prefix) reads plainly
(:meth:`~KeyMap.to_plain`) and back (:meth:`~KeyMap.from_plain`), and :func:`map_keys`
installs the hooks that apply it to the saved keys and their metadata (the layers'
versions), to the loaded ones and their metadata, wherever the module is (see
:func:`_metadata_loaded`), and to the missing and unexpected keys and the errors (``size
mismatch for 2.weight``) a load reports.

This module knows nothing of partitions or devices: the maps say what the keys are.
"""

from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from types import CodeType
from typing import Any, Protocol, cast

from torch import nn

__all__ = ["KeyMap", "PartitionKeys", "Renaming", "map_keys", "shown"]


class Renaming(Protocol):
    """Other names for a pipeline's plain keys: a model's own names, for a pipeline of
    pieces that hold its modules (gpipe-transformers' causal LMs). The pipeline's
    :meth:`~torch.nn.Module.named_parameters`, ``named_buffers``, ``named_modules`` and
    ``state_dict`` show them; its own bookkeeping keeps the plain keys."""

    def rename(self, key: str) -> str | None:
        """The name of the plain key (or module path) ``key``; None for a module of the
        pipeline's own that the model does not have (a piece)."""

    def key(self, name: str) -> str | None:
        """The plain key of the name ``name``; None for a name that is not one of them."""


def shown(key: str, renaming: Renaming | None) -> str:
    """How errors name the plain key (or module path) ``key``: by ``renaming``'s name, if
    it has one."""
    return key if renaming is None else renaming.rename(key) or key


class KeyMap(ABC):
    """How the keys inside one module (after its prefix) read plainly, and back.

    One instance serves one module (it keeps the state of the loads under way).
    """

    def __init__(self) -> None:
        #: The loads under way, innermost last.
        self.loading: list[_Load] = []

    @abstractmethod
    def to_plain(self, module: nn.Module, key: str) -> str | None:
        """The plain key of ``key`` (``''``: the module's own metadata entry), or None for
        an entry the plain module does not have (a container of the module's own)."""

    @abstractmethod
    def from_plain(self, module: nn.Module, key: str) -> str | None:
        """Where the plain ``key`` goes inside the module (``key`` itself when it is not
        the module's to map), or None to leave it out of the load (a layer that another
        process holds)."""

    # -- the hooks ---------------------------------------------------------------------------

    def saved(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _: object) -> None:
        """State dict post-hook: the keys and their metadata, under the plain keys."""
        for key in [key for key in state_dict if key.startswith(prefix)]:
            plain = self.to_plain(module, key[len(prefix) :])
            if plain is not None:
                state_dict[prefix + plain] = state_dict.pop(key)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is None:
            return
        own = prefix[:-1]
        renamed = {}
        for key in [key for key in metadata if key != own and key.startswith(prefix)]:
            value = metadata.pop(key)
            plain = self.to_plain(module, key[len(prefix) :])
            if plain is not None:
                renamed[_join(prefix, plain)] = value
        metadata.update(renamed)

    def load(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: object,
        strict: object,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load pre-hook: the plain keys go where the module holds them, and so do their
        metadata entries (the layers' versions, which torch looks up under the keys where
        the module holds the layers)."""
        renamed: dict[str, str] = {}
        for key in [key for key in state_dict if key.startswith(prefix)]:
            inner = self.from_plain(module, key[len(prefix) :])
            if inner is None:
                del state_dict[key]
            else:
                state_dict[prefix + inner] = state_dict.pop(key)
                if prefix + inner != key:
                    renamed[prefix + inner] = key
        metadata = _metadata_loaded(state_dict)
        added: list[str] = []
        if metadata is not None:
            own = prefix[:-1]
            for key in [key for key in metadata if key == own or key.startswith(prefix)]:
                inner = self.from_plain(module, key[len(prefix) :] if key != own else "")
                if inner:
                    if _join(prefix, inner) not in metadata:
                        added.append(_join(prefix, inner))
                    metadata[_join(prefix, inner)] = metadata[key]
        self.loading.append(
            _Load(
                prefix, len(missing_keys), len(unexpected_keys), error_msgs, len(error_msgs),
                renamed, metadata, added,
            )
        )  # fmt: skip

    def loaded(self, module: nn.Module, incompatible: Any) -> None:
        """Load post-hook: the missing and unexpected keys the layers reported, and the
        keys the errors name (``size mismatch for ...``), under the plain keys; the
        metadata entries the load added are taken out of the state dict's metadata again."""
        load = self.loading.pop()
        prefix = load.prefix
        for keys, start in (
            (incompatible.missing_keys, load.missing),
            (incompatible.unexpected_keys, load.unexpected),
        ):
            for i in range(start, len(keys)):
                if keys[i].startswith(prefix):
                    plain = self.to_plain(module, keys[i][len(prefix) :])
                    if plain is not None:
                        keys[i] = prefix + plain
        if load.renamed:
            errors = load.errors
            for i in range(load.error_count, len(errors)):
                errors[i] = _KEY.sub(lambda m: load.renamed.get(m[0], m[0]), errors[i])
        if load.metadata is not None:
            for key in load.added:
                load.metadata.pop(key, None)


@dataclass
class _Load:
    """A load under way into a module whose keys a :class:`KeyMap` maps."""

    prefix: str
    missing: int  # how many missing keys were reported before it
    unexpected: int  # and unexpected keys
    errors: list[str]  # the load's error messages
    error_count: int  # how many there were before it
    renamed: dict[str, str]  # each key moved, where the module holds it -> its plain key
    metadata: dict[str, Any] | None  # the state dict's metadata
    added: list[str]  # the entries added to it


#: A key in an error message (dots inside, a word character last).
_KEY = re.compile(r"[\w.]*\w")


def _torch_load_code() -> CodeType | None:
    """The code of the function inside :meth:`torch.nn.Module.load_state_dict` that loads
    each module (None if torch has no such function)."""
    for constant in nn.Module.load_state_dict.__code__.co_consts:
        if isinstance(constant, CodeType) and constant.co_name == "load":
            return constant
    return None


_TORCH_LOAD = _torch_load_code()


def _metadata_loaded(state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The metadata of the state dict being loaded (the layers' versions, by module key).

    A module's load pre-hook gets a state dict that carries it only when the module is the
    one whose :meth:`~torch.nn.Module.load_state_dict` was called: torch hands a module
    inside another one its keys in a plain dict, and looks the module's children's
    entries up in the metadata of the state dict it was given (the variable ``metadata``
    of its loading function). A layer under a :class:`~gpipe_core.WithDevice` is always
    inside another module, and a GPipe may be; their entries must move all the same (a
    quantized layer reads its keys by its version), so the metadata is found there. None
    when there is none, or when the load is not torch's.
    """
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        return cast(dict[str, Any], metadata)
    frame = sys._getframe(1)
    while frame is not None and _TORCH_LOAD is not None:
        if frame.f_code is _TORCH_LOAD:
            found = frame.f_locals.get("metadata")
            return cast(dict[str, Any], found) if isinstance(found, dict) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _join(prefix: str, key: str) -> str:
    return prefix + key if key else prefix[:-1]


def map_keys(module: nn.Module, keys: KeyMap) -> None:
    """Give ``module``'s state dict the plain keys that ``keys`` maps to."""
    # Partials rather than bound methods: torch marks a hook with an attribute, which a
    # bound method cannot take; like the map, they pickle.
    module.register_state_dict_post_hook(partial(KeyMap.saved, keys))  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(partial(KeyMap.load, keys))  # type: ignore[no-untyped-call]
    module.register_load_state_dict_post_hook(partial(KeyMap.loaded, keys))  # type: ignore[no-untyped-call]


class PartitionKeys(KeyMap):
    """A layer's keys are ``partitions.J.<layer>.<rest>`` in the pipeline, ``<layer>.<rest>``
    plainly (layers keep their names in the partitions). A load takes torchgpipe's keys
    (``partitions.J.<layer>.<rest>``) as they are unless ``partitions`` is a layer's name,
    and leaves the keys of the layers other ranks run to them.

    Args:
        partitions: the partitions (this rank's; another rank's are empty).
        remote: the names of the layers other ranks run.
        renaming: the names the keys are saved and loaded under, if not the plain keys.
    """

    def __init__(
        self,
        partitions: Sequence[nn.Sequential],
        remote: set[str],
        renaming: Renaming | None = None,
    ) -> None:
        super().__init__()
        self.owner = {
            name: j for j, partition in enumerate(partitions) for name in partition._modules
        }
        self.remote = remote
        self.renaming = renaming

    def to_plain(self, module: nn.Module, key: str) -> str | None:
        if key == "partitions" or (key.count(".") < 2 and key.startswith("partitions.")):
            return None  # the partitions themselves
        if key.startswith("partitions."):
            key = key.split(".", 2)[2]
        return key if self.renaming is None else self.renaming.rename(key)

    def from_plain(self, module: nn.Module, key: str) -> str | None:
        if self.renaming is not None:
            key = self.renaming.key(key) or key
        layer = key.partition(".")[0]
        j = self.owner.get(layer)
        if j is not None:
            return f"partitions.{j}.{key}"
        return None if layer in self.remote else key
