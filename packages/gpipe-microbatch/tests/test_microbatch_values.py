"""Values that are not tensors, and NoChunk tensors: scatter, gather, Batch and check_output."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_microbatch import Batch, NoChunk, check_output, gather, scatter

SETTINGS = settings(max_examples=40, deadline=None)

# -- NoChunk ----------------------------------------------------------------------------------


def test_nochunk_holds_its_tensor() -> None:
    mask = torch.ones(3)
    assert NoChunk(mask).tensor is mask
    assert repr(NoChunk(torch.zeros(1))) == "NoChunk(tensor([0.]))"


@pytest.mark.parametrize(("value", "seen"), [([1], "list"), (None, "NoneType"), (2.0, "float")])
def test_nochunk_refuses_what_is_not_a_tensor(value: object, seen: str) -> None:
    with pytest.raises(TypeError, match=re.escape(f"NoChunk wraps a tensor (tensor: {seen})")):
        NoChunk(value)  # type: ignore[arg-type]


# -- scatter ----------------------------------------------------------------------------------


@SETTINGS
@given(batch_size=st.integers(1, 20), chunks=st.integers(1, 8))
def test_scatter_passes_nochunk_and_other_values_whole(batch_size: int, chunks: int) -> None:
    x = torch.randn(batch_size, 2)
    mask = torch.randn(5)  # another length than the batch: it is not split
    options = {"k": [1, 2]}
    batches = scatter((x, NoChunk(mask), 0.5, "tag", None, options), chunks)
    pieces = x.chunk(chunks)
    assert len(batches) == len(pieces)
    for batch, piece in zip(batches, pieces, strict=True):
        assert not batch.atomic
        assert batch.present == (True, True, False, False, False, False)
        assert torch.equal(batch.tensors[0], piece)
        assert batch.tensors[1] is mask  # unwrapped, the very tensor
        assert batch.others == (0.5, "tag", None, options)
        assert batch.others[3] is options
        assert len(batch) == 2  # a batch is the sequence of its tensors


def test_scatter_one_micro_batch_unwraps_nochunk() -> None:
    x, mask = torch.randn(3, 2), torch.randn(2)
    (batch,) = scatter((NoChunk(mask), x, 7), chunks=1)
    assert batch.values == (mask, x, 7)
    assert batch.values[1] is x
    (empty,) = scatter((torch.zeros(0, 2), NoChunk(mask)), chunks=4)
    assert empty.values[1] is mask


def test_scatter_nochunk_needs_no_batch_dimension() -> None:
    batches = scatter((torch.zeros(4, 1), NoChunk(torch.tensor(2.0))), chunks=2)
    assert [b.tensors[1].item() for b in batches] == [2.0, 2.0]


def test_scatter_splits_only_tensors_for_the_batch_size() -> None:
    # The NoChunk tensor's length (3) would disagree with the batch size (4).
    batches = scatter((torch.zeros(4), NoChunk(torch.zeros(3))), chunks=2)
    assert [len(b.tensors[0]) for b in batches] == [2, 2]
    with pytest.raises(ValueError, match=re.escape("(batch sizes: input[0]: 4, input[1]: 3)")):
        scatter((torch.zeros(4), torch.zeros(3)), chunks=2)


@pytest.mark.parametrize(
    ("value", "seen"),
    [
        (None, "input: NoneType"),
        ("text", "input: str"),
        ((), "input: empty tuple"),
        ((1, 2.0), "input[0]: int, input[1]: float"),
        (NoChunk(torch.zeros(2)), "input: NoChunk"),
        ((NoChunk(torch.zeros(2)), None), "input[0]: NoChunk, input[1]: NoneType"),
    ],
)
def test_scatter_needs_a_tensor_to_split(value: object, seen: str) -> None:
    message = (
        "input must hold a tensor to split into micro-batches; NoChunk tensors and values "
        f"that are not tensors are passed whole ({seen})"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        scatter(value, 2)


@pytest.mark.parametrize(
    ("value", "seen"),
    [
        ([torch.zeros(2)], "input: list holding a tensor"),
        ((torch.zeros(2), [1, (torch.zeros(2),)]), "input[1]: list holding a tensor"),
        ((torch.zeros(2), {"a": torch.zeros(2)}), "input[1]: dict holding a tensor"),
        ((torch.zeros(2), {torch.zeros(2): 1}), "input[1]: dict holding a tensor"),
        ((torch.zeros(2), [NoChunk(torch.zeros(2))]), "input[1]: list holding a tensor"),
    ],
)
def test_scatter_refuses_tensors_inside_other_values(value: object, seen: str) -> None:
    message = "input holds a tensor inside another value"
    with pytest.raises(TypeError, match=re.escape(message) + ".*" + re.escape(f"({seen})")):
        scatter(value, 2)


def test_scatter_names_the_input_with_what() -> None:
    with pytest.raises(TypeError, match=re.escape("(inputs[0]: int, inputs[1]: str)")):
        scatter((1, "a"), 2, what="inputs")
    with pytest.raises(ValueError, match=re.escape("target[1] must have a batch dimension")):
        scatter((torch.zeros(2), torch.tensor(1.0)), 2, what="target")


def test_scatter_survives_a_container_holding_itself() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    batches = scatter((torch.zeros(4), loop), 2)
    assert all(b.others == (loop,) for b in batches)


# -- gather -----------------------------------------------------------------------------------


def test_gather_lists_values_that_are_not_tensors() -> None:
    outputs = [Batch((torch.zeros(2, 1), i, "t")) for i in range(3)]
    out, numbers, tags = gather(outputs)  # type: ignore[misc]
    assert out.shape == (6, 1)
    assert numbers == [0, 1, 2] and tags == ["t", "t", "t"]


def test_gather_one_micro_batch_lists_too() -> None:
    x = torch.zeros(2)
    out = gather([Batch((x, None))])
    assert isinstance(out, tuple) and out[0] is x and out[1] == [None]
    assert gather([Batch(7)]) == [7]


def test_gather_refuses_micro_batches_of_different_kinds() -> None:
    with pytest.raises(TypeError, match=re.escape("(micro-batch 0: Tensor, micro-batch 1: tuple)")):
        gather([Batch(torch.zeros(1)), Batch((torch.zeros(1), 1))])
    message = "hold a tensor in some micro-batches and another value in others"
    with pytest.raises(TypeError, match=re.escape(message)):
        gather([Batch((torch.zeros(1), 1)), Batch((torch.zeros(1), torch.zeros(1)))])
    with pytest.raises(TypeError, match=re.escape("(micro-batch 0: 2, micro-batch 1: 3)")):
        gather([Batch((torch.zeros(1), 1)), Batch((torch.zeros(1), 1, 2))])


def test_gather_names_the_value_that_is_a_tensor_in_some_micro_batches_only() -> None:
    """By its key in a mapping, its index in a tuple."""
    t = torch.zeros(1)
    with pytest.raises(TypeError) as info:
        gather([Batch({"a": t, "b": t}), Batch({"a": t, "b": None})])
    assert str(info.value) == (
        "micro-batch outputs hold a tensor in some micro-batches and another value in others: "
        "a value must be a tensor in every micro-batch or in none "
        "(output['b'] of micro-batch 0: Tensor, of micro-batch 1: NoneType)"
    )
    with pytest.raises(TypeError, match=re.escape("(output[1] of micro-batch 0: int, of")):
        gather([Batch((t, 1)), Batch((t, t))])


@SETTINGS
@given(batch_size=st.integers(1, 20), chunks=st.integers(1, 8))
def test_gather_round_trip_with_other_values(batch_size: int, chunks: int) -> None:
    x = torch.randn(batch_size, 2)
    batches = scatter((x, "a", NoChunk(torch.ones(1))), chunks)
    out, tags, ones = gather(batches)  # type: ignore[misc]
    assert torch.equal(out, x)
    assert tags == ["a"] * len(batches)
    # A NoChunk tensor is a tensor in every micro-batch: gathered like the others.
    assert torch.equal(ones, torch.ones(len(batches)))


# -- Batch ------------------------------------------------------------------------------------


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


# -- check_output -----------------------------------------------------------------------------


def test_check_output_accepts_values_beside_a_tensor() -> None:
    x = torch.zeros(1)
    for value in (x, (x,), (x, 1, "a", None, [1, 2], {"k": (3,)})):
        assert check_output(value) is value


MUST = "must be a tensor, or a tuple or mapping holding a tensor"
NESTED = "holds a tensor inside another value"
NOCHUNK = "holds a NoChunk, which marks inputs only"


@pytest.mark.parametrize(
    ("value", "message", "seen"),
    [
        (None, MUST, "out: NoneType"),
        ((1, "a"), MUST, "out[0]: int, out[1]: str"),
        ((), MUST, "out: empty tuple"),
        ([torch.zeros(1)], MUST, "out: list holding a tensor"),
        ((torch.zeros(1), [torch.zeros(1)]), NESTED, "out[1]: list holding a tensor"),
        ((torch.zeros(1), NoChunk(torch.zeros(1))), NOCHUNK, "out[1]: NoChunk"),
    ],
)
def test_check_output_refuses(value: object, message: str, seen: str) -> None:
    pattern = re.escape(f"out {message}") + ".*" + re.escape(f"({seen})")
    with pytest.raises(TypeError, match=pattern):
        check_output(value, "out")
