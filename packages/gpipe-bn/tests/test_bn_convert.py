"""convert_deferred_batch_norm: what is replaced, what is kept, and bad arguments."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, spectral_norm, weight_norm

from gpipe_bn import (
    DeferredBatchNorm,
    convert_deferred_batch_norm,
    convert_plain_batch_norm,
    mini_batch,
)


class Block(nn.Module):
    """A module that is not a container, with batch norms as attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.heads = nn.ModuleDict({"a": nn.BatchNorm1d(4), "b": nn.ModuleList([nn.ReLU()])})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](self.bn(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize(
    ("layer", "dim"),
    [(nn.BatchNorm1d(5), 1), (nn.BatchNorm2d(5), 2), (nn.BatchNorm3d(5), 3)],
)
def test_each_kind(layer: nn.Module, dim: int) -> None:
    converted = convert_deferred_batch_norm(layer, chunks=3)
    assert isinstance(converted, DeferredBatchNorm)
    assert converted.dim == dim
    assert converted.chunks == 3
    assert converted.num_features == 5


def test_the_tree_is_converted_in_place() -> None:
    block = Block()
    model = nn.Sequential(nn.BatchNorm2d(3), block, nn.ReLU())
    bn, head = block.bn, block.heads["a"]
    assert convert_deferred_batch_norm(model, 2) is model
    assert isinstance(model[0], DeferredBatchNorm)
    assert isinstance(block.bn, DeferredBatchNorm) and block.bn.dim == 2
    assert isinstance(block.heads["a"], DeferredBatchNorm) and block.heads["a"].dim == 1
    assert isinstance(block.heads["b"][0], nn.ReLU)
    assert block.bn.weight is bn.weight and block.bn.running_var is bn.running_var
    assert block.heads["a"].running_mean is head.running_mean
    assert not any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, DeferredBatchNorm)
        for m in model.modules()
    )
    assert model(torch.randn(2, 3, 5, 5)).shape == (2, 4)


def test_parameters_buffers_and_settings_are_kept() -> None:
    layer = nn.BatchNorm2d(6, eps=1e-3, momentum=None).double()
    with torch.no_grad():
        layer.weight.uniform_()
        layer.running_mean.uniform_()
        layer.num_batches_tracked.fill_(7)
    layer.bias.requires_grad_(False)
    layer.eval()
    state = {name: tensor.clone() for name, tensor in layer.state_dict().items()}

    converted = convert_deferred_batch_norm(layer)
    assert isinstance(converted, DeferredBatchNorm)
    assert (converted.eps, converted.momentum) == (1e-3, None)
    assert converted.affine and converted.track_running_stats
    assert not converted.training
    assert converted.weight.requires_grad and not converted.bias.requires_grad
    assert converted.weight.dtype == torch.float64
    assert converted.weight is layer.weight and converted.bias is layer.bias
    assert converted.state_dict().keys() == state.keys()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, state[name]), name
        assert tensor.dtype == state[name].dtype, name


def test_no_affine_and_no_running_statistics() -> None:
    layer = nn.BatchNorm1d(3, affine=False, track_running_stats=False)
    converted = convert_deferred_batch_norm(layer)
    assert isinstance(converted, DeferredBatchNorm)
    assert converted.weight is None and converted.bias is None
    assert converted.running_mean is None and converted.num_batches_tracked is None
    assert list(converted.state_dict()) == []


def test_on_the_meta_device() -> None:
    converted = convert_deferred_batch_norm(nn.BatchNorm2d(3, device="meta"))
    assert isinstance(converted, DeferredBatchNorm)
    assert all(t.device.type == "meta" for t in converted.state_dict().values())


@pytest.mark.cuda
def test_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer = nn.BatchNorm2d(3).cuda().half()
    converted = convert_deferred_batch_norm(layer)
    assert isinstance(converted, DeferredBatchNorm)
    assert converted.running_mean.device.type == "cuda"
    assert converted.weight.dtype == torch.float16
    converted(torch.randn(4, 3, 2, 2, device="cuda", dtype=torch.float16))
    assert int(converted.num_batches_tracked) == 1


def test_a_layer_used_at_two_places_is_refused() -> None:
    # nn.BatchNorm would update its statistics once per place; deferred, they would be
    # pooled over both places and counted once.
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(shared, nn.Linear(4, 4), shared)
    with pytest.raises(ValueError, match=r"used at several places .* \(places: \['0', '2'\]\)"):
        convert_deferred_batch_norm(model)
    assert model[0] is shared and model[2] is shared  # unchanged


def test_mini_batch_refuses_a_deferred_layer_used_at_two_places() -> None:
    shared = DeferredBatchNorm(4)
    model = nn.Sequential(shared, nn.Linear(4, 4), shared)
    with pytest.raises(ValueError, match="used at several places"), mini_batch(model):
        pass


def test_subclasses_are_converted_other_norms_are_not() -> None:
    class MyBatchNorm(nn.BatchNorm2d):
        pass

    already = DeferredBatchNorm(4, chunks=5)
    model = nn.Sequential(MyBatchNorm(4), nn.SyncBatchNorm(4), nn.LayerNorm(4), already)
    convert_deferred_batch_norm(model, chunks=2)
    assert isinstance(model[0], DeferredBatchNorm) and model[0].dim == 2
    assert type(model[1]) is nn.SyncBatchNorm
    assert type(model[2]) is nn.LayerNorm
    assert model[3] is already and already.chunks == 5


def test_lazy_batch_norm() -> None:
    lazy = nn.LazyBatchNorm2d()
    with pytest.raises(ValueError, match=r"first forward pass .*LazyBatchNorm2d"):
        convert_deferred_batch_norm(nn.Sequential(lazy))
    lazy(torch.randn(2, 3, 2, 2))
    assert type(lazy) is nn.BatchNorm2d
    converted = convert_deferred_batch_norm(lazy)
    assert isinstance(converted, DeferredBatchNorm) and converted.num_features == 3


def parametrized() -> nn.Module:
    layer = nn.BatchNorm1d(3)
    parametrize.register_parametrization(layer, "weight", nn.Softplus())
    return layer


@pytest.mark.parametrize(
    ("make", "seen"),
    [
        (parametrized, "(module: ParametrizedBatchNorm1d, parameters: ['bias'], buffers: "),
        (
            lambda: weight_norm(nn.BatchNorm1d(3), dim=0),
            "(module: BatchNorm1d, parameters: ['bias', 'weight_g', 'weight_v'], buffers: ",
        ),
        (
            lambda: spectral_norm(nn.BatchNorm1d(3)),
            "parameters: ['bias', 'weight_orig'], buffers: ['running_mean', 'running_var', "
            "'num_batches_tracked', 'weight_u', 'weight_v'], modules: [])",
        ),
    ],
)
def test_reparametrized_batch_norm_is_refused(make: Any, seen: str) -> None:
    # The weight lives elsewhere (a parametrization, tensors and hooks of weight_norm or
    # spectral_norm) and a new layer would not carry it: refuse rather than drop it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm is deprecated
        layer = make()
    model = nn.Sequential(layer)
    with pytest.raises(ValueError, match=re.escape(seen)):
        convert_deferred_batch_norm(model)
    assert model[0] is layer


def test_a_refused_layer_leaves_the_tree_as_it_was() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2), nn.Sequential(nn.BatchNorm2d(2), nn.LazyBatchNorm1d()))
    with pytest.raises(ValueError, match="first forward pass"):
        convert_deferred_batch_norm(model)
    assert type(model[0]) is nn.BatchNorm1d
    assert type(model[1][0]) is nn.BatchNorm2d


@pytest.mark.parametrize("module", [None, "model", torch.zeros(2), [nn.BatchNorm1d(2)]])
def test_not_a_module(module: object) -> None:
    message = f"module must be an nn.Module (module: {type(module).__name__})"
    with pytest.raises(TypeError, match=re.escape(message)):
        convert_deferred_batch_norm(module, chunks=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -1, 2.0, False, None])
def test_bad_chunks(chunks: object) -> None:
    model = nn.Sequential(nn.BatchNorm1d(2))
    message = f"chunks must be a positive integer (chunks: {chunks!r})"
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_deferred_batch_norm(model, chunks)  # type: ignore[arg-type]
    assert type(model[0]) is nn.BatchNorm1d  # nothing was converted


@pytest.mark.parametrize(
    ("dim", "kind", "shape"),
    [
        (1, nn.BatchNorm1d, (4, 3)),
        (2, nn.BatchNorm2d, (4, 3, 2, 2)),
        (3, nn.BatchNorm3d, (4, 3, 1, 2, 2)),
        (None, None, (4, 3, 2)),
    ],
)
def test_plain_layers_hold_the_deferred_layers_tensors(
    dim: int | None, kind: type[nn.Module] | None, shape: tuple[int, ...]
) -> None:
    deferred = DeferredBatchNorm(3, momentum=None, chunks=2, dim=dim)
    x = torch.randn(*shape)
    with mini_batch(deferred):
        for micro in x.chunk(2):
            deferred(micro)
    block = nn.Sequential(nn.Identity(), nn.Sequential(deferred))
    plain = convert_plain_batch_norm(block)
    layer = plain[1][0]
    assert kind is None or type(layer) is kind
    assert not isinstance(layer, DeferredBatchNorm)
    assert layer.weight is deferred.weight and layer.running_var is deferred.running_var
    assert layer.momentum is None and layer.eps == deferred.eps
    # The model itself is left as it is; modules without deferred layers are its own.
    assert block[1][0] is deferred and plain is not block and plain[0] is block[0]
    assert list(plain.state_dict()) == list(block.state_dict())
    layer(x)  # updates the statistics at once, in the deferred layer's tensors too
    assert int(deferred.num_batches_tracked) == 2
    assert convert_plain_batch_norm(nn.Linear(2, 2)).__class__ is nn.Linear


def test_converting_to_plain_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"module must be an nn.Module \(module: str\)"):
        convert_plain_batch_norm("bn")  # type: ignore[arg-type]
