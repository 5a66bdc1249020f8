"""Tests of check, scatter, gather and Batch."""

from __future__ import annotations

import re
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_microbatch import Batch, check, gather, make_tuple, scatter

SETTINGS = settings(max_examples=40, deadline=None)

# -- check ------------------------------------------------------------------------------


def test_check_returns_tensor_itself() -> None:
    x = torch.zeros(2)
    assert check(x) is x


def test_check_returns_tuple_itself() -> None:
    value = (torch.zeros(2), torch.ones(3, dtype=torch.long))
    assert check(value) is value


@pytest.mark.parametrize(
    ("value", "type_name"),
    [([torch.zeros(1)], "list"), (None, "NoneType"), (3, "int"), ({"a": torch.zeros(1)}, "dict")],
)
def test_check_names_the_type(value: object, type_name: str) -> None:
    with pytest.raises(TypeError) as info:
        check(value)
    assert str(info.value) == (f"input must be a tensor or a tuple of tensors (input: {type_name})")


def test_check_names_the_bad_tuple_element() -> None:
    with pytest.raises(TypeError) as info:
        check((torch.zeros(1), torch.zeros(1), 1.5))
    assert str(info.value) == "input must be a tensor or a tuple of tensors (input[2]: float)"


def test_check_empty_tuple() -> None:
    with pytest.raises(TypeError, match=r"\(input: empty tuple\)"):
        check(())


def test_check_uses_what() -> None:
    with pytest.raises(TypeError) as info:
        check([1], "output of partition 1")
    assert str(info.value) == (
        "output of partition 1 must be a tensor or a tuple of tensors (output of partition 1: list)"
    )


# -- scatter ----------------------------------------------------------------------------


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


# -- gather -----------------------------------------------------------------------------


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


# -- Batch ------------------------------------------------------------------------------


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


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True, None])
def test_check_chunks_names_the_value(bad: object) -> None:
    from gpipe_microbatch import check_chunks

    with pytest.raises(
        ValueError, match=rf"chunks must be a positive integer \(chunks: {re.escape(repr(bad))}\)"
    ):
        check_chunks(bad)


def test_check_chunks_returns_a_positive_integer() -> None:
    from gpipe_microbatch import check_chunks

    assert check_chunks(3) == 3


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


# -- tuple subclasses --------------------------------------------------------------------------


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


def test_scatter_and_gather_keep_a_namedtuple() -> None:
    value = Pair(torch.arange(6.0), "a")
    batches = scatter(value, chunks=3)
    assert all(type(batch.value) is Pair and batch.kind is Pair for batch in batches)
    assert batches[1].value.x.tolist() == [2.0, 3.0]
    assert type(scatter(value, chunks=1)[0].value) is Pair
    gathered = gather(batches)
    assert type(gathered) is Pair
    assert gathered.label == ["a", "a", "a"]


def test_batches_made_from_parts_keep_the_tuple_type() -> None:
    result = torch.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)
    batch = Batch(result)
    assert type(batch.with_tensors([torch.zeros(2), torch.ones(2)]).value) is type(result)
    again = Batch.from_parts(False, batch.present, batch.tensors, batch.others, batch.kind)
    assert type(again.value) is type(result)
    assert again.value.indices.tolist() == [1, 0]
    assert type(Batch((torch.zeros(1), 2)).value) is tuple


def test_make_tuple_builds_each_kind_of_tuple() -> None:
    assert make_tuple(Pair, [torch.zeros(1), "b"]).label == "b"
    kind = type(torch.zeros(2, 2).max(dim=1))
    assert make_tuple(kind, (torch.zeros(2), torch.ones(2))).values.tolist() == [0.0, 0.0]
    assert make_tuple(tuple, iter([1, 2])) == (1, 2)
