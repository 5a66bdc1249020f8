"""WithDevice: a layer placed on a device, for the partitions GPipe reads from the module.

Devices are compared as torch compares those of tensors: ``'cpu'`` and ``'cpu:0'`` are one
device. Reading partitions from the module needs a second device: on the CPU alone the
layers' runs are checked where they are read (:func:`balance_from_placement`), with the
``meta`` device (where a layer made for deferred initialization is) as the other one, and
GPipe's split across devices on a GPU (the ``cuda`` marker). A wrapper may name a device
this machine lacks (``'cuda:0'``): it moves nothing, and GPipe refuses it only when it
places it, so refusals of a wrapper in a CPU partition need no GPU.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import Pop, Stash
from gpipe_core import GPipe, WithDevice
from gpipe_core._partition import balance_from_placement

CPU, META = torch.device("cpu"), torch.device("meta")
needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks a refusal without CUDA"
)

on_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class AddScaled(nn.Module):
    """A layer called with several arguments and a keyword."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * y


def plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())


def placed_model(device: torch.device | str) -> nn.Sequential:
    """:func:`plain_model` with its last three layers placed on ``device``."""
    model = plain_model()
    return nn.Sequential(
        model[0],
        model[1],
        WithDevice(model[2], device),
        WithDevice(model[3], device),
        model[4],  # without parameters: with the layer before it
    )


def relu_placed(device: str) -> nn.Sequential:
    """Linear layers, the ReLU after the first placed on ``device``."""
    return nn.Sequential(
        nn.Linear(2, 2), WithDevice(nn.ReLU(), device), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)
    )


# -- the wrapper itself ---------------------------------------------------------------------


def test_the_wrapper_exposes_its_module_and_device() -> None:
    relu = nn.ReLU()
    wrapped = WithDevice(relu, "cpu")
    assert wrapped.module is relu
    assert wrapped.device == torch.device("cpu")
    assert list(wrapped.children()) == [relu]
    assert repr(wrapped) == "WithDevice(\n  device=cpu\n  (module): ReLU()\n)"


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (torch.device("cpu"), torch.device("cpu")),
        ("cpu", torch.device("cpu")),
        ("cpu:0", CPU),  # one CPU, as for tensors
        ("cuda:1", torch.device("cuda", 1)),  # not checked until GPipe places the layer
        (1, torch.device("cuda", 1)),  # an index is a CUDA device, as in devices=
    ],
)
def test_devices_are_read_as_gpipe_reads_them(device: Any, expected: torch.device) -> None:
    assert WithDevice(nn.ReLU(), device).device == expected


def test_the_device_cannot_be_reassigned() -> None:
    wrapped = WithDevice(nn.ReLU(), "cpu")
    with pytest.raises(AttributeError):
        wrapped.device = torch.device("cuda", 0)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("module", "device", "error", "message"),
    [
        ("relu", "cpu", TypeError, "module must be an nn.Module (module: 'relu')"),
        (nn.ReLU, "cpu", TypeError, "module must be an nn.Module (module: <class"),
        (
            WithDevice(nn.ReLU(), "cpu"),
            "cpu",
            TypeError,
            "module is a WithDevice already: wrap the layer once (module: WithDevice(ReLU) on cpu)",
        ),
        (
            nn.ReLU(),
            None,
            TypeError,
            "device must be a device, a device name or an index (device: None)",
        ),
        (
            nn.ReLU(),
            True,
            TypeError,
            "device must be a device, a device name or an index (device: True)",
        ),
        (
            nn.ReLU(),
            1.5,
            TypeError,
            "device must be a device, a device name or an index (device: 1.5)",
        ),
        (
            nn.ReLU(),
            "bogus",
            ValueError,
            "device must be a device, a device name or an index (device: 'bogus')",
        ),
        (nn.ReLU(), -1, ValueError, "a device index cannot be negative (device: -1)"),
        (
            nn.ReLU(),
            "meta",
            ValueError,
            "device must be a device that holds tensors' data; moving layers to meta would "
            "lose their weights (device: 'meta')",
        ),
    ],
)
def test_bad_arguments_are_refused(
    module: Any, device: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        WithDevice(module, device)


def test_the_forward_pass_is_the_wrapped_layers() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    x = torch.randn(5, 3, requires_grad=True)
    output = WithDevice(linear, "cpu")(x)
    (grad,) = torch.autograd.grad(output.sum(), x)
    expected = linear(x)
    assert torch.equal(output, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), x)[0])
    # Any arguments, keywords included, go through as they are.
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert torch.equal(WithDevice(AddScaled(), "cpu")(a, b, scale=3.0), a + 3.0 * b)


def test_the_wrapper_moves_nothing_by_itself() -> None:
    # Named, not used: the layer runs where it is, with or without a GPU on the machine.
    linear = nn.Linear(2, 2)
    WithDevice(linear, "cuda:0")(torch.randn(1, 2))
    assert linear.weight.device == CPU


# -- keys: the wrapped layer's ----------------------------------------------------------------


def test_a_wrapped_layer_has_the_layers_keys() -> None:
    plain, placed = plain_model(), placed_model("cpu")
    expected = plain.state_dict()
    state = placed.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    # torch's per-module metadata (versions) is that of the plain model too.
    assert list(state._metadata) == list(expected._metadata)  # type: ignore[attr-defined]
    assert state._metadata["3"] == expected._metadata["3"]  # type: ignore[attr-defined]
    # At the top too.
    assert list(WithDevice(nn.Linear(2, 2), "cpu").state_dict()) == ["weight", "bias"]


def test_checkpoints_load_with_and_without_wrappers() -> None:
    trained = plain_model()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    placed = placed_model("cpu")
    placed.load_state_dict(trained.state_dict())  # strict: every key found
    for (name, ours), theirs in zip(placed.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(ours, theirs), name
    back = plain_model()
    back.load_state_dict(placed.state_dict())
    for (name, ours), theirs in zip(back.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(ours, theirs), name
    wrapped = WithDevice(nn.Linear(2, 2), "cpu")
    wrapped.load_state_dict(nn.Linear(2, 2).state_dict())


def test_strict_loading_still_reports_wrong_keys() -> None:
    wrapped = nn.Sequential(WithDevice(nn.Linear(2, 2), "cpu"))
    state = nn.Sequential(nn.Linear(2, 2)).state_dict()
    state["0.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"0.extra\""):
        wrapped.load_state_dict(state)
    del state["0.extra"], state["0.bias"]
    result = wrapped.load_state_dict(state, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == []
    # Nested wrappers, at the top: every key named as in the module without wrappers.
    inner = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.Linear(2, 2), "cpu"))
    outer = WithDevice(inner, "cpu")
    state = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict()
    del state["1.weight"]
    state["1.x"] = state["2.y"] = torch.zeros(1)
    result = outer.load_state_dict(state, strict=False)
    assert result.missing_keys == ["1.weight"]
    assert sorted(result.unexpected_keys) == ["1.x", "2.y"]


def quantized(seed: int) -> nn.Module:
    """A quantized linear layer, whose keys depend on its version (``_packed_params``, not
    ``weight``): it loads only with its metadata."""
    torch.manual_seed(seed)
    layer = torch.ao.nn.quantized.Linear(4, 4)
    layer.set_weight_bias(
        torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.qint8), torch.randn(4)
    )
    return layer


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:.*quantized tensor creation:UserWarning")
def test_a_layer_with_a_version_loads_inside_a_wrapper() -> None:
    """The metadata of a wrapped layer (its version, and its own layers') goes with its keys
    to where the wrapper holds it, also when the wrapper is inside a module (as it always
    is): the model's own checkpoint loads, and so do the plain model's, in both ways."""
    x = torch.randn(3, 4)
    trained = nn.Sequential(nn.Linear(4, 4), WithDevice(quantized(1), "cpu"))
    trained[1].module.scale = 0.05
    expected = trained[1](torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)).dequantize()

    def same(model: nn.Module) -> None:
        got = model[1](torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)).dequantize()
        assert torch.equal(got, expected)

    state = trained.state_dict()
    metadata = dict(state._metadata)  # type: ignore[attr-defined]
    wrapped = nn.Sequential(nn.Linear(4, 4), WithDevice(quantized(2), "cpu"))
    wrapped.load_state_dict(state)  # its own checkpoint
    same(wrapped)
    assert state._metadata == metadata  # type: ignore[attr-defined]  # left as it was
    plain = nn.Sequential(nn.Linear(4, 4), quantized(3))
    plain.load_state_dict(state)  # into the model without wrappers
    same(plain)
    wrapped = nn.Sequential(nn.Linear(4, 4), WithDevice(quantized(4), "cpu"))
    wrapped.load_state_dict(plain.state_dict())  # and back
    same(wrapped)


def test_a_size_mismatch_names_the_plain_key() -> None:
    state = plain_model().state_dict()
    state["2.weight"] = torch.zeros(8, 3)
    errors = []
    for model in (plain_model(), placed_model("cpu")):
        with pytest.raises(RuntimeError) as caught:
            model.load_state_dict(state)
        errors.append(str(caught.value))
    assert "size mismatch for 2.weight: copying a param with shape" in errors[0]
    assert errors[1] == errors[0]


def test_copies_keep_the_layers_keys() -> None:
    # A device other than the layers' own, so that the copies keep what was named.
    placed = placed_model("cuda:1")
    for copied in (copy.deepcopy(placed), pickle.loads(pickle.dumps(placed))):
        assert list(copied.state_dict()) == list(plain_model().state_dict())
        assert isinstance(copied[2], WithDevice) and copied[2].device == torch.device("cuda", 1)


# -- GPipe: placement from the wrappers -------------------------------------------------------


def test_partitions_follow_the_wrappers() -> None:
    # Every parameter on meta: the wrapped layers are on the CPU all the same, and the
    # activation after them joins them. (Through GPipe, on a GPU:
    # test_a_wrapped_layer_goes_to_its_gpu.)
    with torch.device("meta"):
        model = placed_model("cpu")
    assert model[2].module.weight.is_meta
    assert balance_from_placement(model) == ([2, 3], [META, CPU])


def test_a_wrapper_on_another_device_splits_there() -> None:
    # The layer after the wrapped one starts a partition on its own device again.
    with torch.device("meta"):
        model = relu_placed("cpu")
    assert balance_from_placement(model) == ([1, 1, 3], [META, CPU, META])


def test_wrappers_on_the_layers_own_device_change_nothing() -> None:
    # Every layer on the CPU, wrapped or not: still one device, still the hint.
    for model in (
        nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "cpu"), nn.Linear(2, 2)),
        nn.Sequential(WithDevice(nn.ReLU(), "cpu"), nn.Tanh()),
    ):
        with pytest.raises(
            TypeError,
            match=r"balance must be given when every layer is on one device \(layers: \d, "
            r"device: cpu\).*balance_by_time",
        ):
            GPipe(model)


def test_layers_without_parameters_or_wrappers_get_the_hint() -> None:
    with pytest.raises(TypeError, match=r"no layer has parameters or a WithDevice"):
        GPipe(nn.Sequential(nn.ReLU(), nn.Tanh()))


@needs_no_cuda
def test_a_cuda_wrapper_without_cuda_is_refused_when_placed() -> None:
    model = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "cuda:0"))
    model(torch.randn(1, 2))  # the model itself runs: the wrapper moves nothing
    with pytest.raises(
        ValueError,
        match=re.escape(
            "a WithDevice names a CUDA device but CUDA is not available "
            "(layer 1: WithDevice(ReLU) on cuda:0)"
        ),
    ):
        GPipe(model)


def test_the_pipeline_holds_the_layers_without_their_wrappers() -> None:
    model = placed_model("cpu")
    linear = model[2].module
    pipe = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=2)
    assert pipe[2] is linear and pipe.partitions[1][0] is linear
    assert not any(isinstance(m, WithDevice) for m in pipe.modules())
    plain = pipe.unwrap()
    assert list(plain._modules) == ["0", "1", "2", "3", "4"]
    assert plain[2] is linear
    assert not any(isinstance(m, WithDevice) for m in plain.modules())
    # The caller's module keeps its wrappers, around the same layers.
    assert isinstance(model[2], WithDevice) and model[2].module is linear


def test_names_are_kept() -> None:
    model = nn.Sequential(
        OrderedDict([("first", nn.Linear(2, 2)), ("second", WithDevice(nn.Linear(2, 2), "cpu"))])
    )
    pipe = GPipe(model, [1, 1], devices=["cpu", "cpu"])
    assert list(pipe.unwrap()._modules) == ["first", "second"]
    assert list(pipe.state_dict()) == ["first.weight", "first.bias", "second.weight", "second.bias"]


def test_the_pipelines_checkpoint_is_the_plain_models() -> None:
    trained = GPipe(placed_model("cpu"), [2, 3], devices=["cpu", "cpu"], chunks=2)
    trained.step(torch.randn(8, 4), torch.randn(8, 8), nn.MSELoss())
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    assert list(checkpoint) == list(plain_model().state_dict())
    plain = plain_model()
    plain.load_state_dict(checkpoint)  # without the wrappers
    placed = placed_model("cpu")
    placed.load_state_dict(checkpoint)  # with them
    resumed = GPipe(placed_model("cpu"), [2, 3], devices=["cpu", "cpu"], chunks=2)
    resumed.load_state_dict(checkpoint)
    x = torch.randn(5, 4)
    for module in (plain, placed, resumed, trained):
        module.eval()
    with torch.no_grad():
        expected = plain(x)
        assert torch.equal(placed(x), expected)
        torch.testing.assert_close(resumed(x), expected)
        torch.testing.assert_close(trained(x), expected)


@pytest.mark.parametrize(
    ("device", "balance"),
    [
        ("cpu", [2, 2]),  # one device: the balance splits, the wrappers agree
        pytest.param("cuda:0", None, marks=on_cuda),  # the wrappers split
    ],
)
def test_a_wrapped_skippable_layer_pairs_up(device: str, balance: list[int] | None) -> None:
    def layers(wrap: bool) -> nn.Sequential:
        torch.manual_seed(0)
        last = [nn.Linear(4, 4), Pop()]
        if wrap:
            last = [WithDevice(layer, device) for layer in last]
        return nn.Sequential(nn.Linear(4, 4), Stash(), *last)

    devices = None if balance is None else ["cpu", device]
    pipe = GPipe(layers(wrap=True), balance, devices=devices, chunks=2)
    assert pipe.balance == [2, 2]
    assert [d.type for d in pipe.devices] == ["cpu", torch.device(device).type]
    assert [(r.stash_partition, r.pop_partition) for r in pipe.skip_layout.routes] == [(0, 1)]
    assert_matches_plain(pipe, layers(wrap=False), torch.randn(4, 4))


def test_a_wrapped_batch_norm_is_deferred() -> None:
    model = placed_model("cpu")
    pipe = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    assert type(pipe[3]).__name__ == "DeferredBatchNorm"
    assert model[3].module is pipe[3]  # converted in place, inside the wrapper


# -- "cpu" and "cpu:0": one device, as for tensors ---------------------------------------------


def test_cpu_and_cpu_0_are_one_device() -> None:
    # torch puts a tensor made on "cpu:0" on device(type='cpu'): GPipe compares devices so.
    cpu = torch.device("cpu")
    assert torch.randn(1, device="cpu:0").device == cpu
    for name in ("cpu:0", torch.device("cpu", 0)):
        assert WithDevice(nn.ReLU(), name).device == cpu
    # No split without balance: every layer is on the CPU, wrapped on "cpu:0" or not.
    with pytest.raises(
        TypeError,
        match=re.escape(
            "balance must be given when every layer is on one device (layers: 5, device: cpu)"
        ),
    ):
        GPipe(placed_model("cpu:0"))
    # Accepted with a balance that puts the wrappers in a "cpu" partition.
    pipe = GPipe(placed_model("cpu:0"), [2, 3], devices=["cpu", "cpu"], chunks=2)
    assert pipe.devices == [cpu, cpu]
    assert_matches_plain(pipe.eval(), plain_model().eval(), torch.randn(6, 4))
    pipe = GPipe(placed_model("cpu"), [1, 4], devices=["cpu:0", "cpu"], chunks=2)
    assert pipe.devices == [cpu, cpu]
    assert pipe(torch.randn(6, 4)).device == cpu  # the input's device is the first partition's
    # devices=["cpu", "cpu:0"]: two partitions on "cpu", which take a CPU input.
    pipe = GPipe(placed_model("cpu"), [2, 3], devices=["cpu", "cpu:0"], chunks=2)
    assert pipe.devices == [cpu, cpu]
    assert "devices=['cpu', 'cpu']" in repr(pipe)
    assert_matches_plain(pipe.eval(), plain_model().eval(), torch.randn(6, 4))


# -- GPipe: balance and devices given ----------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=on_cuda)])
def test_a_given_split_that_agrees_with_the_wrappers_is_taken(device: str) -> None:
    pipe = GPipe(placed_model(device), [1, 1, 3], devices=["cpu", "cpu", device], chunks=2)
    assert pipe.balance == [1, 1, 3]
    assert pipe.partitions[2][0].weight.device.type == torch.device(device).type
    assert_matches_plain(pipe.eval(), plain_model().eval(), torch.randn(6, 4))
    # Wrappers on the CPU agree with the default devices without CUDA.
    if not torch.cuda.is_available():
        GPipe(placed_model("cpu"), [2, 3])


# The wrappers name "cuda:0", the partitions are on the CPU: refused with or without a GPU
# (the placement is checked before whether the wrapper's device exists).
@pytest.mark.parametrize(
    ("placed", "balance", "devices", "message"),
    [
        (
            ["cuda:0", "cuda:0"],
            [3, 2],
            ["cpu", "cpu"],
            "a WithDevice layer must be in a partition on its device (layer 2: "
            "WithDevice(Linear) on cuda:0, partition 0 on cpu, balance: [3, 2], "
            "devices: ['cpu', 'cpu'])",
        ),
        (
            ["cpu:0", "cuda:0"],  # the first wrapper agrees (the CPU): the second is named
            [2, 1, 2],
            ["cpu", "cpu", "cpu"],
            "(layer 3: WithDevice(BatchNorm1d) on cuda:0, partition 2 on cpu,",
        ),
        (
            ["cuda:0", "cuda:0"],
            [2, 3],
            ["cpu", "cpu"],
            "(layer 2: WithDevice(Linear) on cuda:0, partition 1 on cpu,",
        ),
    ],
)
def test_a_given_split_against_the_wrappers_is_refused_before_anything_changes(
    placed: list[str], balance: list[int], devices: list[Any], message: str
) -> None:
    model = placed_model(placed[0])
    model[3] = WithDevice(model[3].module, placed[1])
    with pytest.raises(ValueError, match=re.escape(message)):
        GPipe(model, balance, devices=devices, deferred_batch_norm=True)
    assert type(model[3].module) is nn.BatchNorm1d  # not converted


@needs_no_cuda
def test_given_balance_without_devices_checks_the_default_devices() -> None:
    with pytest.raises(ValueError, match=r"WithDevice\(Linear\) on cuda:0, partition 1 on cpu"):
        GPipe(placed_model("cuda:0"), [2, 3])


def test_a_nested_wrapper_is_refused() -> None:
    block = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "cpu"))
    message = (
        "WithDevice must be a layer of the sequential module itself, where it places the "
        "layer (layer 1 (Sequential) has one at '1')"
    )
    for balance in ([1, 1], None):
        with pytest.raises(TypeError, match=re.escape(message)):
            GPipe(nn.Sequential(nn.Linear(2, 2), block), balance)
    wrapped_block = WithDevice(nn.Sequential(WithDevice(nn.ReLU(), "cpu")), "cpu")
    with pytest.raises(TypeError, match=r"layer 0 \(WithDevice\) has one at '0'"):
        GPipe(nn.Sequential(wrapped_block), [1], devices=["cpu"])


# -- on GPUs -----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wrapped_layer_goes_to_its_gpu() -> None:
    model = placed_model("cuda")
    linear = model[2].module
    pipe = GPipe(model, chunks=2)
    assert pipe.balance == [2, 3]
    assert [d.type for d in pipe.devices] == ["cpu", "cuda"]
    assert linear.weight.device == pipe.devices[1]  # moved by GPipe
    assert_matches_plain(pipe.eval(), plain_model().eval(), torch.randn(6, 4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wrapper_on_a_gpu_splits_there() -> None:
    # The layer after the wrapped one starts a partition on the CPU again.
    pipe = GPipe(relu_placed("cuda:0"))
    assert pipe.balance == [1, 1, 3]
    assert pipe.devices == [CPU, torch.device("cuda", 0), CPU]
    assert pipe(torch.randn(3, 2)).device == CPU


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_a_layer_without_parameters_starts_the_next_gpus_partition() -> None:
    model = nn.Sequential(
        nn.Linear(16, 8).cuda(0), WithDevice(nn.Dropout(), "cuda:1"), nn.Linear(8, 4).cuda(1)
    )
    pipe = GPipe(model, chunks=4)
    assert pipe.balance == [1, 2]
    assert pipe.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    output = pipe(torch.randn(8, 16, device="cuda:0"))
    assert output.device == torch.device("cuda", 1)
