"""Mappings as micro-batches: a dict, an OrderedDict, a keyword-constructed OrderedDict
subclass (as Hugging Face's ModelOutput) and a collections.abc.Mapping split, gathered and
checked keeping their type and keys."""

from __future__ import annotations

import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from gpipe_microbatch import (
    Batch,
    MappingContainer,
    NoChunk,
    check_output,
    gather,
    make_value,
    mapping_container,
    scatter,
)


class Output(OrderedDict[str, Any]):
    """Made as Hugging Face's ModelOutput: keywords only, the keys of the values given."""

    def __init__(self, *, logits: Any = None, hidden: Any = None, note: Any = None) -> None:
        super().__init__()
        for key, value in (("logits", logits), ("hidden", hidden), ("note", note)):
            if value is not None:
                self[key] = value


class Frozen(Mapping[str, Any]):
    """A read-only mapping made from one mapping."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Opaque(Frozen):
    """A mapping that cannot be made from its items either way."""

    def __init__(self, first: Any, second: Any, third: Any) -> None:
        super().__init__({"a": first, "b": second})


def _dict(x: torch.Tensor) -> dict[str, Any]:
    return {"x": x, "scale": NoChunk(torch.tensor([2.0, 3.0])), "name": "n", "none": None}


@pytest.mark.parametrize(
    "make",
    [
        _dict,
        lambda x: OrderedDict(_dict(x)),
        lambda x: Output(logits=x, hidden=NoChunk(torch.ones(2)), note="n"),
        lambda x: Frozen(_dict(x)),
    ],
    ids=["dict", "OrderedDict", "keywords", "Mapping"],
)
def test_scatter_and_gather_keep_type_and_keys(make: Any) -> None:
    x = torch.arange(10.0).reshape(5, 2)
    value = make(x)
    batches = scatter(value, chunks=2)
    assert len(batches) == 2
    for batch, rows in zip(batches, ([0, 1, 2], [3, 4]), strict=True):
        micro = batch.value
        assert type(micro) is type(value)
        assert list(micro.keys()) == list(value.keys())
        first = next(iter(value))
        assert torch.equal(micro[first], x[rows])
        for key, item in value.items():
            if isinstance(item, NoChunk):
                assert micro[key] is item.tensor  # whole, unwrapped
            elif not isinstance(item, torch.Tensor):
                assert micro[key] is item
    gathered = gather(batches)
    assert type(gathered) is type(value)
    assert list(gathered.keys()) == list(value.keys())
    assert torch.equal(gathered[next(iter(value))], x)


def test_one_micro_batch_holds_the_input_tensors() -> None:
    x = torch.zeros(3, 2)
    (batch,) = scatter({"x": x, "n": 1}, chunks=1)
    assert batch.value["x"] is x
    assert batch.container == MappingContainer(dict, ("x", "n"))


def test_batch_of_a_mapping() -> None:
    x = torch.zeros(2)
    batch = Batch(Output(logits=x, note=3))
    assert not batch.atomic and len(batch) == 1
    assert batch.present == (True, False) and batch.others == (3,)
    assert isinstance(batch.container, MappingContainer) and batch.container.keywords
    again = batch.with_tensors([torch.ones(2)]).value
    assert type(again) is Output and torch.equal(again["logits"], torch.ones(2))
    made = Batch.from_parts(False, (True, False), [x], [3], batch.container).value
    assert type(made) is Output and made["note"] == 3
    assert make_value(batch.container, [x, 4]) == Output(logits=x, note=4)


def test_the_kind_travels_as_a_value() -> None:
    container = Batch(OrderedDict(a=torch.zeros(1))).container
    assert pickle.loads(pickle.dumps(container)) == container


def test_mappings_of_other_keys_are_not_gathered() -> None:
    a, b = Batch({"x": torch.zeros(1)}), Batch({"y": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"mappings need the same type and keys.*\['y'\]"):
        gather([a, b])
    with pytest.raises(TypeError, match="mix single values and tuples or mappings"):
        gather([a, Batch(torch.zeros(1))])


def test_check_output_accepts_mappings() -> None:
    value = {"logits": torch.zeros(1), "loss": None, "past": (1, 2)}
    assert check_output(value) is value
    assert check_output(Output(logits=torch.zeros(1))) is not None


MUST = "must be a tensor, or a tuple or mapping holding a tensor"


@pytest.mark.parametrize(
    ("value", "message", "seen"),
    [
        ({"n": 1}, MUST, "out['n']: int"),
        ({}, MUST, "out: empty dict"),
        ({"x": [torch.zeros(1)]}, "holds a tensor inside another value", "out['x']: list"),
        ({"x": NoChunk(torch.zeros(1))}, "holds a NoChunk", "out['x']: NoChunk"),
        ({0: torch.zeros(1)}, "must have string keys", "out key: 0, an int"),
        (
            Opaque(torch.zeros(1), 1, 2),
            "is a Opaque that cannot be made back from its keys and values",
            "out: Opaque",
        ),
    ],
)
def test_check_output_refuses_mappings(value: object, message: str, seen: str) -> None:
    pattern = re.escape(f"out {message}") + ".*" + re.escape(f"({seen}")
    with pytest.raises(TypeError, match=pattern):
        check_output(value, "out")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"n": 1, "m": NoChunk(torch.zeros(1))}, r"must hold a tensor to split.*input\['n'\]"),
        ({"x": (torch.zeros(2),)}, r"holds a tensor inside another value.*input\['x'\]"),
        ({"x": torch.zeros(2), "y": torch.zeros(3)}, r"input\['y'\] has batch size 3, not the 2"),
        ({1: torch.zeros(2)}, "input must have string keys"),
    ],
)
def test_scatter_refuses_mappings(value: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        scatter(value, chunks=2)


def test_scatter_names_values() -> None:
    with pytest.raises(TypeError, match=r"\(x: int, mask: str\)"):
        scatter((1, "a"), chunks=2, names=["x", "mask"])


def test_mapping_kind_refusal_says_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"Opaque\(\*\*items\).*Opaque\(items\).*return a dict"):
        mapping_container(Opaque(1, 2, 3))
