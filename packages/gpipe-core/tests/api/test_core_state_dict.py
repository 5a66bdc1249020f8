"""Portable checkpoints: a GPipe module's state dict has the plain module's keys.

A checkpoint saved with one balance loads into another balance, into the plain
``nn.Sequential`` and back, and the keys of earlier versions (``partitions.J.``) still
load; ``unwrap`` gives the trained layers as one ``nn.Sequential``.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe_core import GPipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), block, nn.Tanh(), nn.Linear(4, 2))


def trained(balance: list[int]) -> GPipe:
    pipe = GPipe(model(), balance, chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        pipe(torch.randn(8, 4)).pow(2).sum().backward()
        optimizer.step()
    return pipe


def round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, torch.Tensor] = torch.load(buffer)
    return loaded


def same_outputs(*modules: nn.Module) -> None:
    x = torch.randn(6, 4)
    for module in modules:
        module.eval()
    with torch.no_grad():
        first = modules[0](x)
        for module in modules[1:]:
            # Equal up to rounding: micro-batches may take other matmul kernels.
            torch.testing.assert_close(module(x), first)


def test_keys_are_the_plain_models() -> None:
    pipe = trained([2, 3])
    assert list(pipe.state_dict()) == list(model().state_dict())
    assert list(pipe.state_dict()) == list(pipe.unwrap().state_dict())


@settings(max_examples=10, deadline=None)
@given(
    saved=st.sampled_from([[2, 3], [1, 4], [5], [1, 1, 1, 1, 1]]),
    loaded=st.sampled_from([[2, 3], [4, 1], [3, 2], [1, 2, 2]]),
)
def test_a_checkpoint_loads_into_another_balance_and_the_plain_model(
    saved: list[int], loaded: list[int]
) -> None:
    pipe = trained(saved)
    state = round_trip(pipe.state_dict())
    other = GPipe(model(), loaded, chunks=3)
    assert not torch.equal(other[0].weight, pipe[0].weight)
    other.load_state_dict(state)
    plain = model()
    plain.load_state_dict(state)
    back = GPipe(model(), saved, chunks=2)
    back.load_state_dict(round_trip(plain.state_dict()))
    same_outputs(pipe, other, plain, back)


def test_keys_of_earlier_versions_still_load() -> None:
    pipe = trained([2, 3])
    old = OrderedDict(
        (f"partitions.{0 if int(key.split('.')[0]) < 2 else 1}.{key}", value)
        for key, value in pipe.state_dict().items()
    )
    other = GPipe(model(), [2, 3])
    other.load_state_dict(old)
    same_outputs(pipe, other)


def test_missing_and_unexpected_keys_are_reported() -> None:
    state = trained([2, 3]).state_dict()
    del state["4.bias"]
    state["9.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"Missing key.*4\.bias.*|Unexpected key.*9\.weight"):
        GPipe(model(), [2, 3]).load_state_dict(state)


def test_inside_another_module() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pipe = GPipe(model(), [2, 3])

    wrapper = Wrapper()
    with torch.no_grad():
        wrapper.pipe[0].weight.add_(1.0)
    state = wrapper.state_dict()
    assert list(state)[:2] == ["pipe.0.weight", "pipe.0.bias"]
    other = Wrapper()
    other.load_state_dict(state)
    same_outputs(wrapper.pipe, other.pipe)


def test_inside_another_module_the_layers_versions_travel() -> None:
    """The metadata of the layers (their versions) goes where the partitions hold them
    also when the pipeline is inside another module: a checkpoint without a batch norm's
    ``num_batches_tracked`` is refused, as by the plain model, not completed as if it came
    from torch < 0.4.1."""
    outer = nn.Sequential(GPipe(model(), [2, 3]))
    state = outer.state_dict()
    outer.load_state_dict(state)
    del state["0.2.1.num_batches_tracked"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0\.2\.1\.num_b'):
        nn.Sequential(model()).load_state_dict(state)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0\.2\.1\.num_b'):
        outer.load_state_dict(state)


def test_a_size_mismatch_names_the_plain_key() -> None:
    """As the plain model names it, not as the partitions hold it
    (``partitions.1.4.weight``)."""
    state = model().state_dict()
    state["4.weight"] = torch.zeros(2, 3)
    inside = {f"0.{key}": value for key, value in state.items()}
    errors = []
    for module, loaded in (
        (model(), state),
        (GPipe(model(), [2, 3]), state),
        (nn.Sequential(GPipe(model(), [2, 3])), inside),
    ):
        with pytest.raises(RuntimeError) as caught:
            module.load_state_dict(loaded)
        errors.append(str(caught.value).partition("\n")[2])  # after the module's name
    assert errors[0].strip().startswith("size mismatch for 4.weight: copying a param with shape")
    assert errors[1] == errors[0]
    assert errors[2] == errors[0].replace("for 4.weight", "for 0.4.weight")


def test_unwrap_gives_the_trained_layers_in_order() -> None:
    pipe = trained([1, 2, 2])
    plain = pipe.unwrap()
    assert isinstance(plain, nn.Sequential) and len(plain) == len(pipe)
    assert all(a is b for a, b in zip(plain, pipe, strict=True))
    deployed = copy.deepcopy(plain)
    same_outputs(pipe, deployed)


def test_strict_loading_reports_missing_keys_as_the_plain_model_does() -> None:
    """The layers' versions travel with the state dict: a checkpoint without a batch norm's
    ``num_batches_tracked`` is refused, as by the plain model (versions lost, batch norm
    would take it for a checkpoint of torch < 0.4.1 and fill it in), under the plain key."""
    state = trained([2, 3]).state_dict()
    del state["2.1.num_batches_tracked"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2\.1\.num_batches'):
        model().load_state_dict(state)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2\.1\.num_batches'):
        GPipe(model(), [2, 3]).load_state_dict(state)


def test_missing_and_unexpected_keys_have_the_plain_names() -> None:
    state = trained([2, 3]).state_dict()
    del state["4.bias"]
    state["2.0.extra"] = torch.zeros(1)
    plain = model().load_state_dict(state, strict=False)
    pipe = GPipe(model(), [2, 3]).load_state_dict(state, strict=False)
    assert pipe.missing_keys == plain.missing_keys == ["4.bias"]
    assert pipe.unexpected_keys == plain.unexpected_keys == ["2.0.extra"]


def test_a_layer_may_be_named_as_gpipe_names_its_own_parts() -> None:
    def named() -> nn.Sequential:
        torch.manual_seed(1)
        return nn.Sequential(
            OrderedDict(partitions=nn.Linear(4, 4), balance=nn.Tanh(), head=nn.Linear(4, 2))
        )

    pipe = GPipe(named(), [1, 2])
    with torch.no_grad():
        pipe[0].weight.add_(1.0)
    state = round_trip(pipe.state_dict())
    assert list(state) == list(named().state_dict())
    other = GPipe(named(), [2, 1])
    other.load_state_dict(state)
    plain = named()
    plain.load_state_dict(state)
    same_outputs(pipe, other, plain)
