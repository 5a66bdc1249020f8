"""Partitions that draw no random numbers, known from their layers.

In a run with checkpointing, every forward pass holds its device's generator lock so that
the random draws of a checkpointed micro-batch can be replayed exactly (see
``PartitionRun._guarded``): forward passes on one device then take turns. A partition whose
forward pass cannot draw needs neither the lock nor the check that it drew, and its forward
passes run beside the others'. This module decides which, and errs one way only: a
partition it cannot vouch for takes the lock.

A partition cannot draw when (:func:`draws_nothing`) each of its modules is one of the
layers of ``torch.nn`` listed here, of exactly that type (a subclass may override
``forward``), with torch's own ``forward`` (none set on the instance or patched on the
class), no forward or backward hook (a hook runs the user's code), and plain parameters and
buffers (a tensor subclass runs Python code on every operation); no global module hook is
registered; and, for each forward pass (:func:`calls_plainly`), its inputs are plain
(tensors, numbers, strings), and the thread runs no torch function or dispatch mode and no
saved-tensor hooks.

Dropout of every kind, RReLU, fractional max pooling and the attention and transformer
layers (which hold dropout) are not listed. Neither is anything of gpipe's own (a
skippable layer, a nested pipeline), nor any module of the user's.

A partition that may draw can also checkpoint itself (a layer calls torch's checkpoint,
whose recomputation in the backward pass replays the draws of its first pass): a pipeline
learns which of its partitions do from their forward passes' graphs, and keeps it while each
partition is made of the same modules with the same flags (:class:`SelfCheckpointing`).

It must not know runs, devices or gpipe's checkpoints: it reads modules and inputs, and
answers whether they can draw or checkpoint themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

__all__ = ["SelfCheckpointing", "calls_plainly", "draws_nothing"]


def _layers(*names: str) -> frozenset[type[nn.Module]]:
    # By name: a layer missing from this torch is simply not listed.
    return frozenset(getattr(nn, name) for name in names if hasattr(nn, name))


#: Layers whose forward pass draws no random numbers, whatever their arguments and mode.
DRAWLESS: frozenset[type[nn.Module]] = _layers(
    # containers and shapes
    "Sequential", "Identity", "Flatten", "Unflatten",
    # linear and convolutions
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d",
    "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "Embedding", "EmbeddingBag",
    # activations
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish",
    "Sigmoid", "Tanh", "Hardtanh", "Hardsigmoid", "Hardswish", "Hardshrink", "Softshrink",
    "Softplus", "Softsign", "Tanhshrink", "Threshold", "LogSigmoid", "GLU",
    "Softmax", "LogSoftmax", "Softmin", "Softmax2d",
    # normalization
    "LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
    "InstanceNorm3d",
    # pooling, padding, resampling
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "LPPool1d", "LPPool2d",
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d",
    "ReplicationPad1d", "ReplicationPad2d", "ReplicationPad3d",
    "CircularPad1d", "CircularPad2d", "CircularPad3d",
    "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle", "PixelUnshuffle",
    "ChannelShuffle", "Fold", "Unfold",
)  # fmt: skip

# The forward of each listed layer as torch defines it (a forward patched on the class later
# is not the layer's own).
_FORWARDS = {layer: layer.forward for layer in DRAWLESS}

# The hooks a module may hold that run in or around its forward pass (each a dict, empty
# without hooks).
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

# The global module hooks that run in or around forward passes.
_GLOBAL_HOOKS = tuple(
    name
    for name in dir(_module)
    if name.startswith(("_global_forward", "_global_backward")) and name.endswith("hooks")
)


def _global_hooks() -> bool:
    return any(getattr(_module, name, None) for name in _GLOBAL_HOOKS)


def _plain_tensors(tensors: Iterable[Tensor], kind: type[Tensor]) -> bool:
    return all(type(tensor) is kind for tensor in tensors)


def draws_nothing(partition: nn.Module) -> bool:
    """Whether ``partition``'s forward pass cannot draw random numbers, by what it is made
    of (see the module's docstring). Checked once per run: a model may change between
    runs (a hook registered, a layer swapped).

    Example:
        >>> draws_nothing(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        True
        >>> draws_nothing(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
        False
    """
    if _global_hooks():
        return False
    for module in partition.modules():
        layer = type(module)
        if layer not in DRAWLESS or layer.forward is not _FORWARDS[layer]:
            return False
        if "forward" in vars(module):
            return False
        if any(getattr(module, name, None) for name in _HOOKS):
            return False
        if not _plain_tensors(module.parameters(recurse=False), nn.Parameter):
            return False
        if not _plain_tensors(module.buffers(recurse=False), Tensor):
            return False
    return True


def calls_plainly(tensors: Iterable[Tensor], others: Iterable[object] = ()) -> bool:
    """Whether a forward pass on ``tensors`` (and the values beside them that are not
    tensors, ``others``) in this thread runs only the layers' own code: the tensors are
    plain, the other values are plain numbers, strings or None (an object with a
    ``__torch_function__`` of its own could draw), and no torch function or dispatch mode and
    no saved-tensor hooks are active (their code would run inside the pass)."""
    if not _plain_tensors(tensors, Tensor):
        return False
    if not all(type(value) in _PLAIN_VALUES for value in others):
        return False
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


_PLAIN_VALUES = frozenset({type(None), bool, int, float, str})


_SWITCHES = (bool, str, type(None))


def _fingerprint(partition: nn.Module) -> tuple[tuple[int, tuple[object, ...]], ...]:
    """What a partition is made of, as far as whether a layer checkpoints itself may turn
    on it: each module, and its attributes that are booleans, strings or None (``training``,
    transformers' ``gradient_checkpointing``, a layer's own switch); a listed layer of
    ``torch.nn`` (:data:`DRAWLESS`) by itself, as it never checkpoints itself."""
    return tuple(
        (id(module), ())
        if type(module) in DRAWLESS
        else (
            id(module),
            tuple(item for item in vars(module).items() if type(item[1]) in _SWITCHES),
        )
        for module in partition.modules()
    )


class SelfCheckpointing:
    """What a pipeline learned of its partitions: whether a layer of each checkpoints
    itself (torch's checkpoint in its forward pass's graph), kept while the partition's
    fingerprint (its modules, and their attributes that are booleans, strings or None)
    stays the same.

    A run asks :meth:`may_replay` before it starts; a partition whose answer is not known
    is learned (:meth:`learn`) from its first forward pass with a graph.
    """

    def __init__(self) -> None:
        #: Each partition's fingerprint when learned, and whether it checkpoints itself.
        self._known: dict[int, tuple[object, bool]] = {}
        #: The fingerprints of the partitions to learn in the run under way.
        self.pending: dict[int, object] = {}

    def may_replay(self, partitions: Sequence[nn.Module | None], drawless: Sequence[bool]) -> bool:
        """Whether a partition that may draw checkpoints itself, or is not known not to
        (those are to be learned in the run: :attr:`pending`)."""
        self.pending = {}
        replays = False
        for j, partition in enumerate(partitions):
            if partition is None or drawless[j]:
                continue
            fingerprint = _fingerprint(partition)
            known = self._known.get(j)
            if known is None or known[0] != fingerprint:
                self.pending[j] = fingerprint
                replays = True
            elif known[1]:
                replays = True
        return replays

    def learn(self, j: int, checkpoints: bool) -> None:
        """Partition ``j``, pending, checkpoints itself or not."""
        fingerprint = self.pending.pop(j, None)
        if fingerprint is not None:
            self._known[j] = (fingerprint, checkpoints)
