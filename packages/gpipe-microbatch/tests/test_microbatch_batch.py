"""Tests of Batch: a micro-batch, its values and the tensors among them."""

from __future__ import annotations

import re

import pytest
import torch

from gpipe_microbatch import Batch


def test_batch_atomic() -> None:
    x = torch.zeros(4, 2)
    batch = Batch(x)
    assert batch.atomic
    assert batch.tensor is x
    assert batch.tensors == (x,)
    assert batch.value is x
    assert len(batch) == 1
    assert batch[0] is x
    assert list(batch) == [x]


def test_batch_non_atomic() -> None:
    a, b = torch.zeros(2), torch.ones(2)
    batch = Batch((a, b))
    assert not batch.atomic
    assert batch.tensors == (a, b)
    assert batch.value == (a, b)
    assert isinstance(batch.value, tuple)
    assert len(batch) == 2
    assert batch[1] is b
    assert list(batch) == [a, b]
    with pytest.raises(AttributeError, match="non-atomic"):
        _ = batch.tensor


def test_batch_one_element_tuple_is_not_atomic() -> None:
    a = torch.zeros(2)
    batch = Batch((a,))
    assert not batch.atomic
    assert batch.value == (a,)
    assert isinstance(batch.value, tuple)


def test_batch_call_passes_value_and_wraps() -> None:
    seen = []

    def function(value: object) -> object:
        seen.append(value)
        return value[0] + value[1], value[1]  # type: ignore[index]

    a, b = torch.ones(2), torch.full((2,), 2.0)
    out = Batch((a, b)).call(function)
    assert isinstance(seen[0], tuple)
    assert not out.atomic
    assert out[0].tolist() == [3.0, 3.0]
    assert out[1] is b

    atomic = Batch(torch.zeros(4, 2)).call(lambda x: x + 1)
    assert atomic.atomic
    assert torch.equal(atomic.tensor, torch.ones(4, 2))


def test_batch_call_checks_output() -> None:
    with pytest.raises(TypeError) as info:
        Batch(torch.zeros(1)).call(lambda x: [x])
    assert str(info.value) == (
        "output must be a tensor, or a tuple or mapping holding a tensor "
        "(output: list holding a tensor)"
    )
    with pytest.raises(TypeError, match=r"\(result: int\)"):
        Batch(torch.zeros(1)).call(lambda x: 1, "result")


def test_find_tensor_idx_prefers_floating_tensors() -> None:
    ints = torch.zeros(2, dtype=torch.long)
    floats = torch.zeros(2)
    assert Batch((ints, floats)).find_tensor_idx() == 1
    assert Batch((ints, ints, floats, floats)).find_tensor_idx() == 2
    assert Batch((floats, ints)).find_tensor_idx() == 0
    assert Batch((ints, ints)).find_tensor_idx() == 0
    assert Batch(ints).find_tensor_idx() == 0
    assert Batch((ints, torch.zeros(2, dtype=torch.complex64))).find_tensor_idx() == 1
    assert Batch((ints, torch.zeros(2, dtype=torch.bool), floats.half())).find_tensor_idx() == 2


def test_batch_replace() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    batch = Batch((a, b))
    batch.replace(1, c)
    assert batch.tensors == (a, c)
    assert not batch.atomic

    atomic = Batch(a)
    atomic.replace(0, c)
    assert atomic.atomic
    assert atomic.tensor is c
    assert atomic.value is c


def test_batch_repr() -> None:
    assert repr(Batch(torch.zeros(4, 2))) == "Batch[atomic=True]((4, 2))"
    assert repr(Batch((torch.zeros(4, 2), torch.zeros(4)))) == "Batch[atomic=False]((4, 2), (4,))"


# -- values that are not tensors --------------------------------------------------------------


def test_batch_of_mixed_values() -> None:
    a, b = torch.zeros(2), torch.ones(2)
    batch = Batch((a, 3, b, None))
    assert not batch.atomic
    assert batch.tensors == (a, b) and list(batch) == [a, b] and batch[1] is b
    assert batch.present == (True, False, True, False)
    assert batch.others == (3, None)
    assert batch.values == (a, 3, b, None)
    assert batch.value == (a, 3, b, None)
    assert repr(batch) == "Batch[atomic=False]((2,), int, (2,), NoneType)"
    c = torch.full((2,), 2.0)
    batch.replace(1, c)  # among the tensors
    assert batch.values == (a, 3, c, None)


def test_batch_of_one_value_that_is_not_a_tensor() -> None:
    batch = Batch("text")
    assert batch.atomic and batch.value == "text" and len(batch) == 0
    assert batch.present == (False,) and batch.others == ("text",)
    with pytest.raises(AttributeError, match="an atomic batch of a str has no tensor"):
        _ = batch.tensor


def test_batch_with_tensors_keeps_the_other_values() -> None:
    batch = Batch((torch.zeros(1), "a", torch.zeros(1)))
    x, y = torch.ones(1), torch.full((1,), 2.0)
    swapped = batch.with_tensors([x, y])
    assert swapped.values == (x, "a", y) and not swapped.atomic
    assert batch.values[0] is not x  # a new batch
    atomic = Batch(torch.zeros(1)).with_tensors([x])
    assert atomic.atomic and atomic.tensor is x
    with pytest.raises(ValueError, match=re.escape("(batch: 2, tensors: 1)")):
        batch.with_tensors([x])


def test_batch_from_parts() -> None:
    x = torch.zeros(1)
    batch = Batch.from_parts(False, [False, True, False], [x], ["a", None])
    assert batch.values == ("a", x, None)
    assert Batch.from_parts(True, [True], [x]).value is x
    assert Batch.from_parts(True, [False], [], [5]).value == 5
    # All tensors: the same as Batch(tuple).
    assert Batch.from_parts(False, [True, True], [x, x]).present == (True, True)
    for bad in (
        (False, [True], [], []),
        (False, [False], [x], []),
        (True, [True, True], [x, x], []),
    ):
        with pytest.raises(ValueError, match="one tensor per True"):
            Batch.from_parts(*bad)  # type: ignore[arg-type]


def test_batch_call_keeps_other_values() -> None:
    out = Batch((torch.ones(2), 3)).call(lambda v: (v[0] * v[1], "done"))
    assert out.values[1] == "done"
    assert torch.equal(out.tensors[0], torch.full((2,), 3.0))


# -- tuple subclasses -------------------------------------------------------------------------


def test_batches_made_from_parts_keep_the_tuple_type() -> None:
    result = torch.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)
    batch = Batch(result)
    assert type(batch.with_tensors([torch.zeros(2), torch.ones(2)]).value) is type(result)
    again = Batch.from_parts(False, batch.present, batch.tensors, batch.others, batch.container)
    assert type(again.value) is type(result)
    assert again.value.indices.tolist() == [1, 0]
    assert type(Batch((torch.zeros(1), 2)).value) is tuple
