"""Balancing a model whose first layer takes several inputs: a tuple sample is the first
layer's positional arguments, a dict its keyword arguments; values between layers may be
dicts and tuples holding tensors."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gpipe_balance import balance_by_size, balance_by_time, profile_sizes, profile_times
from gpipe_microbatch import NoChunk


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 8)

    def forward(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.table(ids) * attention_mask.unsqueeze(-1)


class Output(OrderedDict[str, Any]):
    """A model output: an ordered dict whose keys are attributes too."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


class ToDict(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Any:
        out = self.kind()
        out["hidden"] = self.linear(x)
        out["note"] = "not a tensor"
        return out


class FromDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, out: Any) -> Tensor:
        assert out["note"] == "not a tensor"
        return self.linear(out["hidden"]).sum(dim=1)


def model(kind: type = dict) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), nn.ReLU(), ToDict(kind), FromDict())


def samples() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(10, (8, 5), generator=generator)
    mask = (torch.rand(8, 5, generator=generator) > 0.3).float()
    return ids, mask


BALANCERS: dict[str, Callable[..., list[int]]] = {
    "balance_by_time": lambda m, x: balance_by_time(2, m, x, timeout=0),
    "balance_by_size": lambda m, x: balance_by_size(2, m, x, chunks=2),
}


@pytest.mark.parametrize("balancer", list(BALANCERS))
@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_first_layer_with_several_inputs(balancer: str, form: str) -> None:
    ids, mask = samples()
    sample: Any = (ids, mask) if form == "tuple" else {"ids": ids, "attention_mask": mask}
    balance = BALANCERS[balancer](model(), sample)
    assert len(balance) == 2 and sum(balance) == 4
    assert torch.equal(ids, samples()[0]) and torch.equal(mask, samples()[1])


@pytest.mark.parametrize("kind", [dict, OrderedDict, Output])
def test_sizes_of_every_form_are_the_same(kind: type) -> None:
    ids, mask = samples()
    by_tuple = profile_sizes(model(kind), (ids, mask), chunks=2)
    by_dict = profile_sizes(model(kind), {"ids": ids, "attention_mask": mask}, chunks=2)
    by_mixed = profile_sizes(model(kind), {"attention_mask": mask, "ids": ids}, chunks=2)
    # The first micro-batch of 8 samples in 2 chunks is the first 4 samples.
    whole = profile_sizes(model(kind), (ids[:4], mask[:4]))
    assert by_tuple == by_dict == by_mixed == whole
    # Activations saved across a dict between layers are measured: ReLU keeps its output
    # (4 x 5 x 8 floats), FromDict's Linear its input inside the dict (the same size).
    assert by_tuple[1] == 4 * 5 * 8 * 4
    parameters = (8 * 4 + 4) * 4 * 2.0
    assert by_tuple[3] == 4 * 5 * 8 * 4 + parameters


def test_gradients_reach_through_dicts() -> None:
    # Backward runs through a dict between layers: the first Linear's backward is timed,
    # and nothing is left on the model.
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, out: dict[str, Tensor]) -> dict[str, Tensor]:
            hidden = out["hidden"]
            seen.append(hidden.requires_grad)
            return {"hidden": hidden * 2, "note": out["note"]}  # type: ignore[dict-item]

    net = nn.Sequential(Embed(), ToDict(dict), Probe(), FromDict())
    assert len(profile_times(net, samples(), timeout=0)) == 4
    assert seen and all(seen)
    assert all(p.grad is None for p in net.parameters())


def test_nochunk_and_other_values_are_passed_whole() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: Tensor, scale: Tensor, factor: float, bias: Tensor) -> Tensor:
            assert scale.shape == (3,) and factor == 0.5 and len(bias) == len(x)
            return self.linear(x) * scale * factor + bias

    net = nn.Sequential(Scaled(), nn.ReLU())
    x, bias = torch.randn(6, 3), torch.randn(6, 3)
    by_tuple = profile_sizes(net, (x, NoChunk(torch.ones(3)), 0.5, bias), chunks=3)
    # Positional arguments named as keywords: a dict names them all.
    sample = {"x": x, "scale": NoChunk(torch.ones(3)), "factor": 0.5, "bias": bias}
    assert profile_sizes(net, sample, chunks=3) == by_tuple
    assert by_tuple == profile_sizes(net, (x[:2], NoChunk(torch.ones(3)), 0.5, bias[:2]))
    assert len(profile_times(net, sample, timeout=0)) == 2


def test_a_dict_taken_as_one_argument_goes_in_a_tuple() -> None:
    net = nn.Sequential(FromDict())
    sample = ({"hidden": torch.randn(4, 8), "note": "not a tensor"},)
    assert len(profile_times(net, sample, timeout=0)) == 1
    assert balance_by_size(1, net, sample, chunks=2) == [1]


@pytest.mark.parametrize("balancer", list(BALANCERS))
def test_a_sample_the_first_layer_rejects(balancer: str) -> None:
    name = "sample" if balancer == "balance_by_time" else "input"
    ids, mask = samples()
    cases: list[tuple[Any, str]] = [
        (ids, rf"{name}: Tensor, passed as one argument"),
        ((ids,), rf"{name}: tuple of 1, passed as 1 positional argument\)"),
        ({"ids": ids, "mask": mask}, rf"{name}: dict of keys \['ids', 'mask'\], passed as keyword"),
        (((ids, mask),), rf"{name}: tuple of 1, passed as 1 positional argument\)"),
    ]
    for sample, form in cases:
        with pytest.raises(TypeError) as error:
            BALANCERS[balancer](model(), sample)
        message = str(error.value)
        assert f"the first layer (Embed.forward(ids, attention_mask)) does not take {name}" in (
            message
        )
        assert re.search(form, message), message
        assert f"pass {name}=(a, b) for forward(a, b), {name}={{'a': a, 'b': b}}" in message


def test_tensors_to_split_need_one_batch_size() -> None:
    ids, mask = samples()
    with pytest.raises(ValueError, match=r"every tensor of input must have the same batch size"):
        profile_sizes(model(), (ids, mask[:4]), chunks=2)
    with pytest.raises(ValueError, match=r"input\[1\] must have a batch dimension"):
        profile_sizes(nn.Sequential(Embed()), (ids, torch.tensor(1.0)), chunks=2)
