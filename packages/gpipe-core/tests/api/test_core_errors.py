"""Wrong arguments and wrong inputs: the error type, and a message naming what was seen."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import gpipe_core._partition as gpipe_partition
from core_support.checks import assert_matches_plain
from core_support.models import MODES
from gpipe_core import BalanceError, GPipe, NoChunk
from gpipe_core._partition import check_split


def three_layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))


# -- module and balance ----------------------------------------------------------------------


def test_module_must_be_sequential() -> None:
    with pytest.raises(TypeError, match=r"module must be nn\.Sequential.*\(module: Linear\)"):
        GPipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\(module: ModuleList\)"):
        GPipe(nn.ModuleList([nn.Linear(2, 2)]), [1])  # type: ignore[arg-type]


def test_balance_error_is_a_value_error() -> None:
    assert issubclass(BalanceError, ValueError)


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        ([2, 2], r"balance must sum to the number of layers (balance: [2, 2], layers: 3)"),
        ([1, 1], r"balance must sum to the number of layers (balance: [1, 1], layers: 3)"),
        ([4], r"balance must sum to the number of layers (balance: [4], layers: 3)"),
        ([3, 0], r"balance must contain only positive integers (balance: [3, 0])"),
        ([4, -1], r"balance must contain only positive integers (balance: [4, -1])"),
        ([1.5, 1.5], r"balance must contain only positive integers (balance: [1.5, 1.5])"),
        ([2, "1"], r"balance must contain only positive integers (balance: [2, '1'])"),
        ([True, 2], r"balance must contain only positive integers (balance: [True, 2])"),
        ([], r"balance must have at least one partition (balance: [])"),
        (3, r"balance must be a list of layer counts (balance: 3)"),
        ("12", r"balance must be a list of layer counts (balance: '12')"),
    ],
)
def test_bad_balance(balance: object, message: str) -> None:
    with pytest.raises(BalanceError, match=re.escape(message)):
        GPipe(three_layers(), balance)  # type: ignore[arg-type]


def test_balance_accepts_any_iterable() -> None:
    pipe = GPipe(three_layers(), (n for n in (2, 1)))
    assert pipe.balance == [2, 1]
    assert isinstance(pipe.balance, list)


def test_balance_error_is_caught_as_value_error() -> None:
    with pytest.raises(ValueError, match=r"balance"):
        GPipe(three_layers(), [1, 1, 1, 1])


# -- devices ---------------------------------------------------------------------------------


def test_too_few_devices() -> None:
    message = "too few devices to hold the partitions (devices: 1, partitions: 2)"
    with pytest.raises(ValueError, match=re.escape(message)):
        GPipe(three_layers(), [2, 1], devices=["cpu"])
    with pytest.raises(ValueError, match=re.escape("(devices: 0, partitions: 1)")):
        GPipe(three_layers(), [3], devices=[])


def test_devices_must_be_a_list() -> None:
    with pytest.raises(TypeError, match=r"devices must be a list of devices.*\(devices: 'cpu'\)"):
        GPipe(three_layers(), [2, 1], devices="cpu")  # type: ignore[arg-type]


def test_extra_devices_are_ignored() -> None:
    pipe = GPipe(three_layers(), [2, 1], devices=["cpu", torch.device("cpu"), "cpu"])
    assert pipe.devices == [torch.device("cpu")] * 2


def test_buffer_shared_across_devices_is_refused() -> None:
    shared = nn.BatchNorm1d(2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    message = (
        "a buffer is shared by partitions on different devices of this process "
        "(0.running_mean in partition 0 on cpu is 2.running_mean in partition 1 on cuda:0), "
        "whose copies would drift apart (a layer may update it in place): put the partitions "
        "that share it on one device, or give each layer its own"
    )
    # The check that GPipe runs before moving anything, called directly (no GPU needed).
    devices = [torch.device("cpu"), torch.device("cuda", 0)]
    with pytest.raises(ValueError, match=re.escape(message)):
        check_split(model, [1, 2], devices)
    assert shared.weight.device.type == "cpu"
    # Another rank's partition (meta here) keeps a replica, and a shared parameter is tied:
    # neither is refused.
    check_split(model, [1, 2], [torch.device("cpu"), torch.device("meta")])
    linear = nn.Linear(2, 2)
    check_split(nn.Sequential(linear, nn.ReLU(), linear), [1, 2], devices)


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        (["cpu", "meta"], ValueError, r"moving layers to meta would lose their weights"),
        (["cpu", "bogus"], ValueError, r"not a device \(devices\[1\]: 'bogus'"),
        (["cpu", None], TypeError, r"devices\[1\]: None"),
        ([1.5, 2], TypeError, r"devices\[0\]: 1.5"),
        ([-1, "cpu"], ValueError, r"cannot be negative \(devices\[0\]: -1"),
    ],
)
def test_bad_devices_are_refused_before_any_layer_moves(
    devices: list[object], error: type[Exception], message: str
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(error, match=message):
        GPipe(model, [1, 1], devices=devices, deferred_batch_norm=True)  # type: ignore[arg-type]
    assert model[0].weight.device.type == "cpu"
    assert type(model[1]) is nn.BatchNorm1d


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_a_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match=r"CUDA is not available \(devices\[1\]: 'cuda:0'"):
        GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1, 1], devices=["cpu", "cuda:0"])


def test_refused_split_leaves_batch_norms_unconverted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend a GPU is there, so that the split itself is refused (a shared buffer).
    monkeypatch.setattr(gpipe_partition, "_device", lambda device, k, devices: torch.device(device))
    shared = nn.BatchNorm1d(2)
    model = nn.Sequential(shared, nn.BatchNorm1d(2), shared)
    with pytest.raises(ValueError, match="shared by partitions on different devices"):
        GPipe(model, [1, 2], devices=["cpu", "cuda:0"], deferred_batch_norm=True)
    assert type(model[1]) is nn.BatchNorm1d


@pytest.mark.parametrize("checkpoint", MODES)
def test_parameter_shared_on_one_device_is_allowed(checkpoint: str) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3).double()
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), shared)
    plain = copy.deepcopy(model)
    assert plain[0] is plain[2]  # deepcopy keeps the sharing
    pipe = GPipe(model, [2, 2, 1], chunks=3, checkpoint=checkpoint)
    assert len(list(pipe.parameters())) == 2

    x = torch.randn(7, 3, dtype=torch.float64)
    assert_matches_plain(pipe, plain, x, input_requires_grad=False)
    # The shared layer's grad gathers the uses in all three places.
    torch.testing.assert_close(shared.weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(shared.bias.grad, plain[0].bias.grad)


# -- chunks, checkpoint, deferred_batch_norm ---------------------------------------------------


@pytest.mark.parametrize("chunks", [0, -1, "a", True, False, 1.0, None])
def test_bad_chunks(chunks: object) -> None:
    message = f"chunks must be a positive integer (chunks: {chunks!r})"
    with pytest.raises(ValueError, match=re.escape(message)):
        GPipe(three_layers(), [3], chunks=chunks)  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint", ["sometimes", "", "ALWAYS", None, True])
def test_bad_checkpoint(checkpoint: object) -> None:
    message = (
        f"checkpoint must be one of 'always', 'except_last', 'never' (checkpoint: {checkpoint!r})"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        GPipe(three_layers(), [3], checkpoint=checkpoint)  # type: ignore[arg-type]


def test_deferred_batch_norm_converts_only_when_asked() -> None:
    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))

    assert type(GPipe(model(), [2], deferred_batch_norm=False)[1]) is nn.BatchNorm1d
    assert type(GPipe(model(), [2], deferred_batch_norm=True)[1]).__name__ == "DeferredBatchNorm"
    # A bad argument leaves the module as it was.
    module = model()
    with pytest.raises(ValueError, match="too few devices"):
        GPipe(module, [1, 1], devices=["cpu"], deferred_batch_norm=True)
    assert type(module[1]) is nn.BatchNorm1d


# -- inputs ----------------------------------------------------------------------------------


def test_input_on_the_wrong_device() -> None:
    pipe = GPipe(three_layers(), [2, 1], chunks=2)
    x = torch.empty(4, 2, device="meta")
    message = "input must be on the first partition's device (devices[0]: cpu, input: meta)"
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe(x)
    # A tuple names the tensor at fault.
    message = "input[1] must be on the first partition's device (devices[0]: cpu, input[1]: meta)"
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe((torch.zeros(4, 2), x))


NO_TENSOR = "must hold a tensor to split into micro-batches"
NESTED = "holds a tensor inside another value"


@pytest.mark.parametrize(
    ("value", "message", "seen"),
    [
        ([torch.zeros(2, 2)], NESTED, "input: list holding a tensor"),
        (None, NO_TENSOR, "input: NoneType"),
        (3.0, NO_TENSOR, "input: float"),
        ({"x": [torch.zeros(2, 2)]}, NESTED, "input['x']: list holding a tensor"),
        ({"n": 1}, NO_TENSOR, "input['n']: int"),
        ((torch.zeros(2, 2), [1, torch.zeros(2)]), NESTED, "input[1]: list holding a tensor"),
        ((torch.zeros(2, 2), {"a": (torch.zeros(2),)}), NESTED, "input[1]: dict holding a tensor"),
        ((), NO_TENSOR, "input: empty tuple"),
        ((1, "a"), NO_TENSOR, "input[0]: int, input[1]: str"),
        ((NoChunk(torch.zeros(2, 2)), None), NO_TENSOR, "input[0]: NoChunk, input[1]: NoneType"),
        (NoChunk(torch.zeros(2, 2)), NO_TENSOR, "input: NoChunk"),
    ],
)
def test_input_must_hold_a_tensor_to_split(value: object, message: str, seen: str) -> None:
    pipe = GPipe(three_layers(), [2, 1], chunks=2)
    for run in (lambda: pipe(value), lambda: pipe.step(value, torch.zeros(2, 2), nn.MSELoss())):
        with pytest.raises(TypeError, match=re.escape(message) + ".*" + re.escape(f"({seen})")):
            run()


def test_several_inputs_are_named_by_position() -> None:
    pipe = GPipe(three_layers(), [2, 1], chunks=2)
    seen = "(inputs[0]: NoChunk, inputs[1]: int)"
    with pytest.raises(TypeError, match=re.escape(NO_TENSOR) + ".*" + re.escape(seen)):
        pipe(NoChunk(torch.zeros(2, 2)), 1)
    with pytest.raises(TypeError, match=re.escape("(inputs[1]: list holding a tensor)")):
        pipe(torch.zeros(2, 2), [torch.zeros(2)])
    with pytest.raises(ValueError, match=re.escape("(batch sizes: inputs[0]: 2, inputs[1]: 3)")):
        pipe(torch.zeros(2, 2), torch.zeros(3, 2))
    with pytest.raises(TypeError, match=re.escape("GPipe needs an input") + ".*(inputs: ())"):
        pipe()
    # Still usable, with a valid input.
    assert pipe(torch.zeros(2, 2)).shape == (2, 2)


def test_target_must_hold_a_tensor_to_split() -> None:
    pipe = GPipe(three_layers(), [2, 1], chunks=2)
    seen = "(target[0]: int, target[1]: NoChunk)"
    with pytest.raises(TypeError, match=re.escape(NO_TENSOR) + ".*" + re.escape(seen)):
        pipe.step(torch.zeros(2, 2), (1, NoChunk(torch.zeros(2))), nn.MSELoss())


def test_nochunk_wraps_a_tensor() -> None:
    with pytest.raises(TypeError, match=re.escape("NoChunk wraps a tensor (tensor: list)")):
        NoChunk([torch.zeros(2)])  # type: ignore[arg-type]


def test_input_batch_sizes_must_agree() -> None:
    pipe = GPipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], chunks=2)
    with pytest.raises(ValueError, match=r"input\[1\] has batch size 3, not the 4 .*NoChunk"):
        pipe((torch.zeros(4, 2), torch.zeros(3, 2)))
    with pytest.raises(ValueError, match=r"batch dimension"):
        pipe(torch.tensor(1.0))


class ReturnsList(nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]


class ReturnsNone(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


class ReturnsInts(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[int, int]:
        return 1, 2


class ReturnsNoChunk(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, NoChunk]:
        return x, NoChunk(x)


class ReturnsNested(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x, {"x": x}


MUST_HOLD = "must be a tensor, or a tuple or mapping holding a tensor"


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(
    ("layer", "j", "balance", "message", "seen"),
    [
        (ReturnsList, 0, [1, 1, 1], MUST_HOLD, "{what}: list holding a tensor"),
        (ReturnsList, 1, [1, 1, 1], MUST_HOLD, "{what}: list holding a tensor"),
        (ReturnsNone, 2, [1, 1, 1], MUST_HOLD, "{what}: NoneType"),
        (ReturnsList, 2, [3], MUST_HOLD, "{what}: list holding a tensor"),
        (ReturnsInts, 1, [1, 1, 1], MUST_HOLD, "{what}[0]: int, {what}[1]: int"),
        (ReturnsNoChunk, 0, [1, 1, 1], "holds a NoChunk, which marks inputs", "{what}[1]: NoChunk"),
        (ReturnsNested, 2, [2, 1], NESTED, "{what}[1]: dict holding a tensor"),
    ],
)
def test_partition_output_must_hold_a_tensor(
    layer: type[nn.Module], j: int, balance: list[int], message: str, seen: str, checkpoint: str
) -> None:
    layers: list[nn.Module] = [nn.Linear(2, 2) for _ in range(3)]
    layers[j] = layer()
    # The bad partition is the one holding layer j.
    partition = next(k for k in range(len(balance)) if j < sum(balance[: k + 1]))
    pipe = GPipe(nn.Sequential(*layers), balance, chunks=2, checkpoint=checkpoint)
    what = f"output of partition {partition}"
    pattern = re.escape(f"{what} {message}") + ".*" + re.escape("(" + seen.format(what=what) + ")")
    with pytest.raises(TypeError, match=pattern):
        pipe(torch.randn(4, 2))
    with pytest.raises(TypeError, match=pattern):
        pipe.step(torch.randn(4, 2), torch.randn(4, 2), nn.MSELoss())


# -- moving the module -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "move",
    [
        pytest.param(lambda m: m.cuda(), id="cuda()"),
        pytest.param(lambda m: m.cuda(0), id="cuda(0)"),
        pytest.param(lambda m: m.cuda("cuda:0"), id="cuda('cuda:0')"),
        pytest.param(lambda m: m.to("meta"), id="to('meta')"),
        pytest.param(lambda m: m.to("meta", torch.float64), id="to('meta', dtype)"),
        pytest.param(lambda m: m.to(torch.zeros(1, device="meta")), id="to(meta tensor)"),
        pytest.param(lambda m: m.to(0), id="to(0)"),
        pytest.param(lambda m: m.to(device=0), id="to(device=0)"),
        pytest.param(lambda m: m.to("cuda"), id="to('cuda')"),
    ],
)
def test_moving_is_refused(move: object) -> None:
    pipe = GPipe(three_layers(), [2, 1])
    message = r"would move every partition to one device.*devices: \['cpu', 'cpu'\]"
    with pytest.raises(TypeError, match=message):
        move(pipe)  # type: ignore[operator]
    # Nothing moved or changed.
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pipe.parameters())


@pytest.mark.parametrize(
    "move",
    [
        pytest.param(lambda m: m.cpu(), id="cpu()"),
        pytest.param(lambda m: m.to("cpu"), id="to('cpu')"),
        pytest.param(lambda m: m.to(torch.device("cpu")), id="to(device)"),
        pytest.param(lambda m: m.to(device="cpu"), id="to(device=)"),
        pytest.param(lambda m: m.to(torch.zeros(1)), id="to(tensor)"),
    ],
)
def test_moving_to_where_every_partition_is_does_nothing(move: object) -> None:
    # Issue 24: model.cpu() on a pipeline all on the CPU raised TypeError.
    pipe = GPipe(three_layers(), [2, 1])
    before = [p.data_ptr() for p in pipe.parameters()]
    assert move(pipe) is pipe  # type: ignore[operator]
    assert [p.data_ptr() for p in pipe.parameters()] == before
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pipe.parameters())
    pipe(torch.randn(4, 2))


def test_a_device_where_every_partition_is_goes_with_a_dtype() -> None:
    pipe = GPipe(three_layers(), [2, 1])
    assert pipe.to("cpu", torch.float64) is pipe
    assert pipe.to(device="cpu", dtype=torch.float16) is pipe
    assert all(p.dtype == torch.float16 for p in pipe.parameters())


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda m: m.to(torch.float64), id="to(float64)"),
        pytest.param(lambda m: m.to(dtype=torch.float64), id="to(dtype=)"),
        pytest.param(lambda m: m.double(), id="double()"),
    ],
)
def test_dtype_conversion_works(convert: object) -> None:
    torch.manual_seed(0)
    model = three_layers()
    plain = copy.deepcopy(model).double()
    pipe = GPipe(model, [2, 1], chunks=2)
    result = convert(pipe)  # type: ignore[operator]
    assert result is pipe
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    assert all(p.dtype == torch.float64 for p in model.parameters())  # the same layers
    x = torch.randn(4, 2, dtype=torch.float64)
    output = pipe(x)
    assert output.dtype == torch.float64
    torch.testing.assert_close(output, plain(x))
