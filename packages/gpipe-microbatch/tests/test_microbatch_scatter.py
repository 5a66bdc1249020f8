"""Tests of scatter and gather: a mini-batch split into micro-batches, and put back together."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_microbatch import Batch, NoChunk, gather, scatter

SETTINGS = settings(max_examples=40, deadline=None)

# -- scatter ----------------------------------------------------------------------------------


@SETTINGS
@given(batch_size=st.integers(1, 40), chunks=st.integers(1, 12), width=st.integers(1, 3))
def test_scatter_follows_torch_chunk(batch_size: int, chunks: int, width: int) -> None:
    x = torch.randn(batch_size, width)
    batches = scatter(x, chunks)
    expected = x.chunk(chunks)
    assert [len(b.tensor) for b in batches] == [len(piece) for piece in expected]
    assert len(batches) <= chunks
    if batch_size < chunks:
        assert len(batches) == batch_size
    assert all(b.atomic for b in batches)
    assert torch.equal(torch.cat([b.tensor for b in batches]), x)


@SETTINGS
@given(batch_size=st.integers(1, 30), chunks=st.integers(1, 10))
def test_scatter_tuple_splits_consistently(batch_size: int, chunks: int) -> None:
    a = torch.arange(batch_size * 2, dtype=torch.float32).view(batch_size, 2)
    b = torch.arange(batch_size)  # an integer tensor
    batches = scatter((a, b), chunks)
    assert len(batches) == len(a.chunk(chunks))
    for batch in batches:
        assert not batch.atomic
        assert len(batch) == 2
        first, second = batch.tensors
        assert first.size(0) == second.size(0)
        # Row i of ``a`` is [2i, 2i + 1] and element i of ``b`` is i: the pieces line up.
        assert torch.equal(first[:, 0].long(), second * 2)
    assert torch.equal(torch.cat([batch[0] for batch in batches]), a)
    assert torch.equal(torch.cat([batch[1] for batch in batches]), b)
    assert batches[0][1].dtype == torch.int64


@SETTINGS
@given(batch_size=st.integers(1, 30), chunks=st.integers(1, 10))
def test_scatter_integer_tensor(batch_size: int, chunks: int) -> None:
    x = torch.arange(batch_size, dtype=torch.int32)
    batches = scatter(x, chunks)
    assert all(b.tensor.dtype == torch.int32 for b in batches)
    assert torch.cat([b.tensor for b in batches]).tolist() == list(range(batch_size))


def test_scatter_example() -> None:
    assert [b.tensor.tolist() for b in scatter(torch.arange(5), chunks=2)] == [[0, 1, 2], [3, 4]]
    assert [len(b.tensor) for b in scatter(torch.arange(10.0), chunks=4)] == [3, 3, 3, 1]


def test_scatter_fewer_micro_batches_than_chunks() -> None:
    batches = scatter(torch.zeros(3, 2), chunks=8)
    assert len(batches) == 3
    assert all(b.tensor.shape == (1, 2) for b in batches)


@pytest.mark.parametrize("chunks", [0, -1, -10])
def test_scatter_non_positive_chunks(chunks: int) -> None:
    with pytest.raises(ValueError) as info:
        scatter(torch.zeros(4), chunks)
    assert str(info.value) == f"chunks must be a positive integer (chunks: {chunks})"


@pytest.mark.parametrize(
    ("chunks", "shown"), [(2.0, "2.0"), ("2", "'2'"), (True, "True"), (None, "None")]
)
def test_scatter_non_int_chunks(chunks: object, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        scatter(torch.zeros(4), chunks)  # type: ignore[arg-type]
    assert str(info.value) == f"chunks must be a positive integer (chunks: {shown})"


def test_scatter_checks_input_type() -> None:
    with pytest.raises(TypeError, match=r"\(input: list holding a tensor\)"):
        scatter([torch.zeros(2)], 2)
    with pytest.raises(TypeError, match=r"must hold a tensor to split.*\(input: list\)"):
        scatter([1], 2)


def test_scatter_zero_dim_tensor() -> None:
    with pytest.raises(ValueError) as info:
        scatter(torch.tensor(1.0), 2)
    assert str(info.value) == "input must have a batch dimension (input: 0-dimensional tensor)"


def test_scatter_zero_dim_tensor_in_tuple() -> None:
    with pytest.raises(ValueError, match=r"input\[1\] must have a batch dimension"):
        scatter((torch.zeros(2), torch.tensor(1.0)), 2)


def test_scatter_mismatched_batch_sizes() -> None:
    with pytest.raises(ValueError) as info:
        scatter((torch.zeros(4, 2), torch.zeros(3)), 2)
    assert str(info.value) == (
        "input[1] has batch size 3, not the 4 of the other tensors of the input: every tensor "
        "split into micro-batches needs the same batch size; wrap input[1] in NoChunk(...) if "
        "it must not be split, to pass it whole to every micro-batch "
        "(batch sizes: input[0]: 4, input[1]: 3)"
    )


def test_scatter_names_the_tensors_of_another_batch_size() -> None:
    """The batch size most tensors share is the input's; the others are named, by the
    names given (keywords) or the keys of a mapping."""
    with pytest.raises(ValueError, match=re.escape(
        "mask, position_ids have batch sizes 2, 1, not the 4 of the other tensors of the "
        "input: every tensor split into micro-batches needs the same batch size; wrap each in "
        "NoChunk(...) if it must not be split, to pass it whole to every micro-batch "
        "(batch sizes: x: 4, y: 4, mask: 2, position_ids: 1)"
    )):  # fmt: skip
        values = (torch.zeros(4), torch.zeros(4), torch.zeros(2), torch.zeros(1, 3))
        scatter(values, 2, names=["x", "y", "mask", "position_ids"])
    with pytest.raises(ValueError, match=re.escape(
        "input['position_ids'] has batch size 1, not the 4 of the other tensors of the input"
    )):  # fmt: skip
        scatter({"ids": torch.zeros(4, 3), "position_ids": torch.zeros(1, 3)}, 2)


def test_scatter_empty_batch_gives_one_empty_micro_batch() -> None:
    x = torch.zeros(0, 3)
    batches = scatter(x, 4)
    assert len(batches) == 1
    assert batches[0].atomic
    assert batches[0].tensor.shape == (0, 3)


def test_scatter_empty_tuple_batch() -> None:
    batches = scatter((torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)), 4)
    assert len(batches) == 1
    assert not batches[0].atomic
    assert [t.shape for t in batches[0]] == [(0, 3), (0,)]


@pytest.mark.parametrize(("batch_size", "chunks"), [(5, 1), (1, 4)])
def test_scatter_into_one_micro_batch_keeps_the_input_itself(batch_size: int, chunks: int) -> None:
    x = torch.randn(batch_size, 3)
    y = torch.arange(batch_size)
    assert scatter(x, chunks)[0].tensor is x
    (pair,) = scatter((x, y), chunks)
    assert pair.tensors[0] is x and pair.tensors[1] is y


def test_scatter_into_several_micro_batches_gives_views() -> None:
    x = torch.randn(4, 3)
    assert all(b.tensor._base is x for b in scatter(x, 2))


# -- scatter: NoChunk tensors and values that are not tensors ---------------------------------


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


@SETTINGS
@given(batch_size=st.integers(1, 30), chunks=st.integers(1, 10))
def test_gather_round_trip_tensor(batch_size: int, chunks: int) -> None:
    x = torch.randn(batch_size, 3)
    out = gather(scatter(x, chunks))
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, x)


@SETTINGS
@given(batch_size=st.integers(1, 30), chunks=st.integers(1, 10))
def test_gather_round_trip_tuple(batch_size: int, chunks: int) -> None:
    value = (torch.randn(batch_size, 3), torch.arange(batch_size))
    out = gather(scatter(value, chunks))
    assert isinstance(out, tuple)
    assert len(out) == 2
    assert torch.equal(out[0], value[0])
    assert torch.equal(out[1], value[1])


def test_gather_keeps_autograd() -> None:
    x = torch.randn(6, 2, requires_grad=True)
    out = gather([Batch(b.tensor * 2) for b in scatter(x, 3)])
    assert isinstance(out, torch.Tensor)
    out.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_gather_single_batch_returns_its_value() -> None:
    x = torch.zeros(2)
    assert gather([Batch(x)]) is x
    pair = (torch.zeros(1), torch.ones(1))
    out = gather([Batch(pair)])
    assert isinstance(out, tuple)
    assert len(out) == 2
    assert out[0] is pair[0]
    assert out[1] is pair[1]


def test_gather_no_batches() -> None:
    with pytest.raises(ValueError, match="at least one micro-batch"):
        gather([])


def test_gather_mixed_atomic() -> None:
    with pytest.raises(TypeError, match="mix single values and tuples or mappings"):
        gather([Batch(torch.zeros(1)), Batch((torch.zeros(1),))])
    with pytest.raises(TypeError):
        gather([Batch((torch.zeros(1),)), Batch(torch.zeros(1))])


def test_gather_tuples_of_different_lengths() -> None:
    with pytest.raises(TypeError, match="different lengths"):
        gather([Batch((torch.zeros(1), torch.zeros(1))), Batch((torch.zeros(1),))])


# -- gather: values that are not tensors ------------------------------------------------------


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


# -- tuple subclasses -------------------------------------------------------------------------


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


def test_scatter_and_gather_keep_a_namedtuple() -> None:
    value = Pair(torch.arange(6.0), "a")
    batches = scatter(value, chunks=3)
    assert all(type(batch.value) is Pair and batch.container is Pair for batch in batches)
    assert batches[1].value.x.tolist() == [2.0, 3.0]
    assert type(scatter(value, chunks=1)[0].value) is Pair
    gathered = gather(batches)
    assert type(gathered) is Pair
    assert gathered.label == ["a", "a", "a"]
