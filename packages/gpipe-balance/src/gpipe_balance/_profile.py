"""Layer profilers: the time and the memory of every layer of an ``nn.Sequential``.

Profiling works on copies: every layer is deep-copied, moved to the profiled device and put
in training mode, one layer at a time, and the copy is dropped once measured. The model
itself is never run, so its parameters, buffers (BatchNorm running statistics included),
``requires_grad`` flags, gradients, training mode and device stay as they were; the random
number generator states (CPU, and the profiled CUDA device) are restored afterwards.

The first layer gets the sample as its arguments (a tuple: positional, a dict: keywords;
see :func:`~gpipe_balance.balance_by_time`). The layers run in order in the calling thread,
each on the previous layer's output, so layers that hand tensors to later layers through
thread-local state (skippable layers, for example) work as in a plain forward pass. The
profiled device is the current CUDA device while they run, as a partition's device is in a
pipeline.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from numbers import Real
from typing import Any, cast

import torch
from torch import Tensor, nn

from gpipe_checkpoint import device_rng_lock, restore_rng_states, save_rng_states
from gpipe_microbatch import Device, check_chunks, check_module, normalize_device, use_device

from ._progress import Progress
from ._sample import Arguments, Sample, arguments, check_call, first_micro_batch, map_tensors
from ._sample import tensors as tensors_in

__all__ = ["profile_sizes", "profile_times", "resolve_device"]


def resolve_device(tensors: list[Tensor], device: Device | None, what: str) -> torch.device:
    """The profiled device: ``device``, or the device of ``tensors`` when it is None.

    Raises:
        ValueError: ``tensors`` are on several devices, or not on ``device``.
    """
    devices = list(dict.fromkeys(tensor.device for tensor in tensors))
    if len(devices) > 1:
        raise ValueError(
            f"{what} must be on one device ({what} devices: {[str(d) for d in devices]})"
        )
    if device is None:
        return devices[0]
    target = normalize_device(device)
    if devices[0] != target:
        raise ValueError(
            f"{what} must be on the profiled device ({what}: {devices[0]}, device: {target})"
        )
    return target


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _preserved_rng(device: torch.device) -> Generator[None, None, None]:
    """Run the body holding ``device``'s generator lock, then put back the generator states.

    The lock keeps a pipeline's checkpointed work from drawing in between (its recomputation
    would not replay its draws); the states are gpipe-checkpoint's, saved and restored
    under its lock.
    """
    with device_rng_lock(device), restore_rng_states(device, save_rng_states(device)):
        yield


# Objects that a layer's copy owns. Other objects copied with one layer (names, namespaces,
# settings) are shared with later layers' copies, as they are shared in the model.
_OWNED = (Tensor, nn.Module, torch.UntypedStorage, torch.TypedStorage, dict, list, tuple, set)


def _layer_copies(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """A training-mode copy of every layer on ``device``, one at a time.

    The copies share one deepcopy memo, so an object that several layers refer to (such as
    the namespace of a skip connection) is one object among the copies too. Tensors and
    modules leave the memo after each layer, so that only one layer is copied at a time.
    """
    memo: dict[int, Any] = {}
    for index, layer in enumerate(module):
        try:
            layer_copy = copy.deepcopy(layer, memo)
        except Exception as error:
            raise TypeError(
                f"layer {index} ({type(layer).__name__}) cannot be copied for profiling: {error}"
            ) from error
        for key in [k for k, v in memo.items() if k != id(memo) and isinstance(v, _OWNED)]:
            del memo[key]
        layer_copy.to(device)
        layer_copy.train()
        for parameter in layer_copy.parameters():
            parameter.grad = None
        yield layer_copy
        del layer_copy


class _Alias(torch.autograd.Function):
    """The input itself (same storage), as the output of an autograd node.

    A layer gets its input through this node, not as a leaf tensor: it may then modify its
    input in place (``nn.ReLU(inplace=True)``) as it may in a plain forward pass.
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _Cut:
    """Cuts a layer's input from the graph before it: each tensor becomes a leaf (keeping
    ``requires_grad``), seen by the layer through an :class:`_Alias`; :attr:`leaves` lists
    them."""

    def __init__(self) -> None:
        self.leaves: list[Tensor] = []

    def __call__(self, value: Tensor) -> Tensor:
        leaf = value.detach()
        self.leaves.append(leaf)
        if not value.requires_grad:
            return leaf
        leaf.requires_grad_()
        return cast(Tensor, _Alias.apply(leaf))  # type: ignore[no-untyped-call]


def _call_layer(layer: nn.Module, input: object) -> tuple[list[Tensor], Callable[[], object]]:
    """The leaves of ``input`` (the previous layer's output, or the first layer's
    :class:`~gpipe_balance._sample.Arguments`) and the call of ``layer`` on it."""
    cut = _Cut()
    if isinstance(input, Arguments):
        given = input.map(cut)
        return cut.leaves, lambda: given.call(layer)
    value = map_tensors(input, cut)
    return cut.leaves, lambda: layer(value)


def _check_output(output: object, index: int) -> object:
    """Refuse a layer output without a tensor, which the next layer could not be profiled on."""
    if next(tensors_in(output), None) is None:
        raise TypeError(
            f"output of layer {index} must be a tensor, or hold one in a tuple, a list or a "
            f"dict (output of layer {index}: {type(output).__name__})"
        )
    return output


def _first_input(sample: Arguments) -> Arguments:
    """A copy of the sample, so that layers that work in place leave the user's sample alone."""
    return sample.map(lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def _check_real(value: object, name: str) -> float:
    """``value`` as a float, after checking that it is a finite, non-negative real number."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number ({name}: {value!r})")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be finite and non-negative ({name}: {value!r})")
    return number


#: The smallest number of measured passes, whatever the timeout (see :func:`profile_times`).
MIN_PASSES = 5
#: The seconds :func:`profile_times` keeps measuring for when no timeout is given.
DEFAULT_TIMEOUT = 1.0


def check_passes(passes: object) -> int:
    """Check that ``passes`` is a positive integer; returns it.

    Raises:
        ValueError: ``passes`` is not a positive integer (booleans are refused too).
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
        raise ValueError(f"passes must be a positive integer (passes: {passes!r})")
    return passes


def profile_times(
    module: nn.Sequential,
    sample: Sample,
    *,
    timeout: float | None = None,
    passes: int = MIN_PASSES,
    device: Device | None = None,
    progress: bool | None = None,
) -> list[float]:
    """The forward plus backward time of every layer of ``module`` on ``sample``, in seconds.

    Every layer runs forward on the previous layer's output and then backward on its own
    output (with a gradient of ones), in training mode. A first pass over the layers warms
    up (it pays one-time costs: allocations, kernel selection, lazy initialization) and is
    not counted. Then at least ``passes`` measured passes run (5 by default), whatever the
    timeout, and more until ``timeout`` seconds have passed since the start. Every layer's
    time is its **median** over the measured passes, so that a pass slowed down by the rest
    of the machine (another process, a garbage collection) does not change it. On CUDA the
    device is synchronized around every measured region, so the times are the kernels'
    times, not the launch times.

    The times are measured, so they vary a little between runs; a balance computed from
    them may too when layers cost about the same. Save the balance you trained with next
    to the model's state (see :func:`~gpipe_balance.balance_by_time`).

    Args:
        module: the model, which is not changed (see the module docstring).
        sample: the first layer's arguments: a tensor (its one argument), a tuple (its
            positional arguments) or a dict (its keyword arguments); ``(pair,)`` passes a
            tuple as one argument. Tensors may sit inside tuples, lists and dicts.
        timeout: seconds to keep repeating the passes for, counted from the start, warm-up
            included. ``0`` runs the minimum passes only. None (the default): until 1 s has
            passed, or the minimum passes are done if they take longer, which is no reason
            to warn.
        passes: the smallest number of measured passes (default 5), run even when they
            take longer than ``timeout``.
        device: the device to profile on; by default the device of ``sample``.
        progress: show a progress bar: True, False, or None (the default) for a bar on
            standard error when it is a terminal and profiling takes more than a second.

    Returns:
        One time per layer, in seconds.

    Raises:
        TypeError: ``module`` is not ``nn.Sequential``, ``sample`` is not a tensor, a tuple
            or a dict holding a tensor, the first layer's ``forward`` does not take the
            arguments it stands for (the message says what to pass), or a layer returns
            no tensor.
        ValueError: ``sample`` is not on ``device``, ``timeout`` is negative or not finite,
            or ``passes`` is not a positive integer.

    Warns:
        UserWarning: a positive ``timeout`` was given and had passed before the warm-up pass
            and the minimum ``passes`` were done: profiling took longer than asked, and the
            times are the median of the minimum number of passes only. The warning names
            the timeout, the passes done and the time they took. A ``timeout`` of 0 asks
            for the minimum passes only, and the default (None) for at least them: neither
            warns.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> len(profile_times(model, torch.randn(4, 8), timeout=0))
        2
    """
    return _profile_times(
        module,
        sample,
        timeout=timeout,
        passes=passes,
        device=device,
        progress=progress,
        stacklevel=3,
    )


def _profile_times(
    module: nn.Sequential,
    sample: Sample,
    *,
    timeout: float | None,
    passes: int,
    device: Device | None,
    progress: bool | None,
    stacklevel: int,
) -> list[float]:
    """:func:`profile_times`, warning ``stacklevel`` frames up (3: the public caller's caller)."""
    module = check_module(module)
    given = arguments(sample, "sample")
    if len(module):
        check_call(module[0], sample, given, "sample")
    target = resolve_device(given.tensors(), device, "sample")
    # Only a timeout the caller chose can be run past; the default one is a budget.
    chosen = timeout is not None
    timeout = DEFAULT_TIMEOUT if timeout is None else _check_real(timeout, "timeout")
    passes = check_passes(passes)
    measured: list[list[float]] = []
    start = time.perf_counter()
    # The bar shows the share of the work done, in percent. The warm-up pass and the minimum
    # measured passes always run, and the passes go on until the timeout: the share is the
    # smaller of the two, and the bar is full only once profiling is done.
    runs = (1 + passes) * len(module)
    done = 0
    bar = Progress("profiling layer times", 100, unit="%", enabled=progress)
    with bar, use_device(target), _preserved_rng(target), torch.enable_grad():

        def tick() -> None:
            nonlocal done
            done += 1
            elapsed = time.perf_counter() - start
            share = min(done / runs, elapsed / timeout if timeout else 1.0)
            bar.update(min(math.floor(100 * share), 99))

        # The first pass pays one-time costs (allocations, kernel selection, lazy
        # initialization): it warms up and is not counted.
        _time_pass(module, given, target, tick)
        while len(measured) < passes:
            measured.append(_time_pass(module, given, target, tick))
        elapsed = time.perf_counter() - start
        if chosen and 0 < timeout < elapsed:
            warnings.warn(
                f"profiling ran past the timeout: the warm-up pass and the minimum {passes}"
                f" measured passes took {elapsed:.3g} s (timeout: {timeout:g} s, passes:"
                f" {len(measured)}); the times are the median of {len(measured)} passes."
                " Raise timeout to measure within it, or lower passes",
                UserWarning,
                stacklevel=stacklevel,
            )
        while elapsed < timeout:
            measured.append(_time_pass(module, given, target, tick))
            elapsed = time.perf_counter() - start
        bar.update(100)
    return [statistics.median(times) for times in zip(*measured, strict=True)]


def _time_pass(
    module: nn.Sequential, sample: Arguments, device: torch.device, tick: Callable[[], None]
) -> list[float]:
    """One pass over the layers; the time of each."""
    times: list[float] = []
    value: object = _first_input(sample)
    for index, layer in enumerate(_layer_copies(module, device)):
        leaves, call = _call_layer(layer, value)

        _synchronize(device)
        began = time.perf_counter()
        output = call()
        _synchronize(device)
        elapsed = time.perf_counter() - began

        value = _check_output(output, index)
        del call, output
        outputs = [tensor for tensor in tensors_in(value) if tensor.requires_grad]
        # Backward reaches this layer's input and parameters, and nothing before them: a
        # tensor that came from an earlier layer by another way (a skip connection) has been
        # through its own layer's backward already.
        targets = [leaf for leaf in leaves if leaf.requires_grad]
        targets += [p for p in layer.parameters() if p.requires_grad]
        if outputs and targets:
            grads = [torch.ones_like(tensor) for tensor in outputs]
            _synchronize(device)
            began = time.perf_counter()
            torch.autograd.backward(outputs, grads, inputs=targets)
            _synchronize(device)
            elapsed += time.perf_counter() - began
            del grads
        del outputs, targets, leaves
        times.append(elapsed)
        tick()
    return times


def _storage_key(tensor: Tensor) -> tuple[object, ...]:
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        # No plain storage (a sparse tensor or a tensor subclass): count it on its own.
        return ("tensor", id(tensor))


def _storage_bytes(tensor: Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return tensor.numel() * tensor.element_size()


def _tensor_bytes(tensors: Iterator[Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def profile_sizes(
    module: nn.Sequential,
    input: Sample,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device | None = None,
    progress: bool | None = None,
) -> list[float]:
    """The memory every layer of ``module`` needs in training, in bytes.

    The memory of a layer is the activation memory it keeps for backward for one
    micro-batch (``input`` split into ``chunks``), plus its parameters times
    ``param_scale``, plus its buffers.

    Activation memory is counted exactly, the same way on every device: the bytes of the
    storages of the tensors that autograd saves for backward while the layer runs forward
    (seen through :class:`torch.autograd.graph.saved_tensors_hooks`), each storage once, so
    views of one tensor are not counted twice. A storage saved by two adjacent layers (the
    output of one, saved again as the input of the next) counts for the first one only.
    The layer's own parameters and buffers are not activations and are left out. Tensors a
    layer keeps in other ways (on an autograd context as attributes, for example) are not
    seen.

    Args:
        module: the model, which is not changed (see the module docstring).
        input: a mini-batch of the size used in training, as the first layer takes it: a
            tensor (its one argument), a tuple (its positional arguments) or a dict (its
            keyword arguments), as for :func:`profile_times`. Its tensors are split along
            dimension 0; :class:`~gpipe_microbatch.NoChunk` tensors, and values that are
            not tensors, are passed whole.
        chunks: the number of micro-batches it will be split into (default 1); the first,
            largest, micro-batch is profiled.
        param_scale: how many copies of the parameters training keeps (default 2.0: the
            parameters and their gradients; optimizers keep more, see the guide).
        device: the device to profile on; by default the device of ``input``.
        progress: show a progress bar: True, False, or None (the default) for a bar on
            standard error when it is a terminal and profiling takes more than a second.

    Returns:
        One size per layer, in bytes.

    Raises:
        TypeError: ``module`` is not ``nn.Sequential``, ``input`` is not a tensor, a tuple
            or a dict holding a tensor, the first layer's ``forward`` does not take the
            arguments it stands for, or a layer returns no tensor.
        ValueError: ``input`` is not on ``device``, ``chunks`` is not a positive integer,
            ``param_scale`` is negative or not finite, or the tensors to split have no batch
            dimension or different batch sizes.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> sizes = profile_sizes(model, torch.randn(4, 8), param_scale=0)
        >>> sizes  # the input the Linear saves, and the output the ReLU saves
        [128.0, 128.0]
    """
    module = check_module(module)
    given = arguments(input, "input")
    if len(module):
        check_call(module[0], input, given, "input")
    chunks = check_chunks(chunks)
    param_scale = _check_real(param_scale, "param_scale")
    target = resolve_device(given.tensors(), device, "input")
    micro_batch = first_micro_batch(given, chunks, "input")

    sizes: list[float] = []
    bar = Progress("profiling layer sizes", len(module), unit="layer", enabled=progress)
    with bar, use_device(target), _preserved_rng(target), torch.enable_grad():
        value: object = _first_input(micro_batch)
        # Storages saved by the previous and the current layer, kept alive while they are
        # remembered so that their addresses cannot be reused by new storages.
        previous: dict[tuple[object, ...], Tensor] = {}
        for index, layer in enumerate(_layer_copies(module, target)):
            owned = {_storage_key(t) for t in [*layer.parameters(), *layer.buffers()]}
            current: dict[tuple[object, ...], Tensor] = {}
            saved = 0

            def pack(
                tensor: Tensor,
                owned: set[tuple[object, ...]] = owned,
                previous: dict[tuple[object, ...], Tensor] = previous,
                current: dict[tuple[object, ...], Tensor] = current,
            ) -> Tensor:
                nonlocal saved
                key = _storage_key(tensor)
                if key not in owned and key not in previous and key not in current:
                    current[key] = tensor
                    saved += _storage_bytes(tensor)
                return tensor

            _, call = _call_layer(layer, value)
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                output = call()
            value = _check_output(output, index)
            del call, output

            parameters = _tensor_bytes(layer.parameters())
            buffers = _tensor_bytes(layer.buffers())
            sizes.append(saved + parameters * param_scale + buffers)
            previous = current
            bar.update(index + 1)
    return sizes


def _unpack(tensor: Tensor) -> Tensor:
    return tensor
