"""State-dict keys: a module that holds layers under other names gives the plain keys.

A :class:`~gpipe_core.GPipe` holds the layer ``3`` of its module as ``partitions.1.3``, and
a :class:`~gpipe_core.WithDevice` holds its layer as ``module``. Both save and load under
the keys of the module without them (``3.weight``), so that a checkpoint moves between
balances, ranks and the plain :class:`~torch.nn.Sequential`. One mechanism does it for
both: a :class:`KeyMap` says how a key inside the module (after its prefix) reads plainly
(:meth:`~KeyMap.to_plain`) and back (:meth:`~KeyMap.from_plain`), and :func:`map_keys`
installs the hooks that apply it to the saved keys and their metadata (the layers'
versions), to the loaded ones, and to the missing and unexpected keys a load reports.

This module knows nothing of partitions or devices: the maps say what the keys are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import partial
from typing import Any

from torch import nn

__all__ = ["KeyMap", "PartitionKeys", "map_keys"]


class KeyMap(ABC):
    """How the keys inside one module (after its prefix) read plainly, and back.

    One instance serves one module (it keeps the state of the loads under way).
    """

    def __init__(self) -> None:
        # (prefix, keys reported before) of each load under way, innermost last.
        self.loading: list[tuple[str, int, int]] = []

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
        error_msgs: object,
    ) -> None:
        """Load pre-hook: the plain keys go where the module holds them, with their
        metadata when the state dict carries it (only a state dict loaded into this
        module itself does: torch hands a module inside a larger one its keys without
        it)."""
        for key in [key for key in state_dict if key.startswith(prefix)]:
            inner = self.from_plain(module, key[len(prefix) :])
            if inner is None:
                del state_dict[key]
            else:
                state_dict[prefix + inner] = state_dict.pop(key)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            own = prefix[:-1]
            for key in [key for key in metadata if key == own or key.startswith(prefix)]:
                inner = self.from_plain(module, key[len(prefix) :] if key != own else "")
                if inner:
                    metadata[_join(prefix, inner)] = metadata[key]
        self.loading.append((prefix, len(missing_keys), len(unexpected_keys)))

    def loaded(self, module: nn.Module, incompatible: Any) -> None:
        """Load post-hook: the missing and unexpected keys the layers reported, under the
        plain keys."""
        prefix, missing, unexpected = self.loading.pop()
        for keys, start in (
            (incompatible.missing_keys, missing),
            (incompatible.unexpected_keys, unexpected),
        ):
            for i in range(start, len(keys)):
                if keys[i].startswith(prefix):
                    plain = self.to_plain(module, keys[i][len(prefix) :])
                    if plain is not None:
                        keys[i] = prefix + plain


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
    """

    def __init__(self, partitions: Sequence[nn.Sequential], remote: set[str]) -> None:
        super().__init__()
        self.owner = {
            name: j for j, partition in enumerate(partitions) for name in partition._modules
        }
        self.remote = remote

    def to_plain(self, module: nn.Module, key: str) -> str | None:
        if key == "partitions" or (key.count(".") < 2 and key.startswith("partitions.")):
            return None  # the partitions themselves
        if key.startswith("partitions."):
            return key.split(".", 2)[2]
        return key

    def from_plain(self, module: nn.Module, key: str) -> str | None:
        layer = key.partition(".")[0]
        j = self.owner.get(layer)
        if j is not None:
            return f"partitions.{j}.{key}"
        return None if layer in self.remote else key
