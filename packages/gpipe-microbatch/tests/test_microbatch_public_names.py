"""The public names of gpipe_microbatch: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

import gpipe_microbatch

NAMES = [
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


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_microbatch, NAMES, [])


def test_streams_copies_and_ordering_are_not_here() -> None:
    # They moved to gpipe-core, their only user, before any release: no alias is kept.
    for name in ["AbstractStream", "CPUStream", "copy", "fork", "join", "new_stream", "wait"]:
        assert not hasattr(gpipe_microbatch, name), name


#: Old names, kept as deprecated aliases of the new ones: not public names any more.
RENAMED = {
    "Kind": "Container",
    "MappingKind": "MappingContainer",
    "mapping_kind": "mapping_container",
}


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_old_names_warn_and_are_the_new_objects(old: str, new: str) -> None:
    assert old not in gpipe_microbatch.__all__
    with pytest.warns(DeprecationWarning, match=f"gpipe_microbatch.{old} is deprecated"):
        value = getattr(gpipe_microbatch, old)
    assert value is getattr(gpipe_microbatch, new)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        gpipe_microbatch.NoSuchName  # noqa: B018


def test_batch_kind_warns_and_is_the_container() -> None:
    batch = gpipe_microbatch.Batch({"x": torch.zeros(1)})
    with pytest.warns(DeprecationWarning, match="Batch.kind is deprecated"):
        kind = batch.kind
    assert kind is batch.container
    assert isinstance(kind, gpipe_microbatch.MappingContainer)
    with pytest.raises(AttributeError):
        batch.kind = tuple  # type: ignore[misc]  # read-only
