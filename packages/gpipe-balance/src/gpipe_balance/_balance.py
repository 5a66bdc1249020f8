"""Automatic balancing: profile the layers of a model, then solve for the balance."""

from __future__ import annotations

from torch import nn

from gpipe_microbatch import Device, check_module

from ._profile import MIN_PASSES, _profile_times, profile_sizes
from ._sample import Sample
from ._solver import check_partitions, solve

__all__ = ["balance_by_size", "balance_by_time"]


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Sample,
    *,
    timeout: float | None = None,
    passes: int = MIN_PASSES,
    device: Device | None = None,
    progress: bool | None = None,
) -> list[int]:
    """A balance of ``module`` into ``partitions`` partitions that evens out compute time.

    Every layer's forward and backward time on ``sample`` is measured
    (:func:`~gpipe_balance.profile_times`), and :func:`~gpipe_balance.solve` returns the
    split whose slowest partition is as fast as possible for those times. After a warm-up
    pass over the layers, at least ``passes`` measured passes run (5 by default) whatever
    the timeout, and more until ``timeout``; every layer's time is its median over the
    passes, which a pass slowed down by the rest of the machine does not change.

    Times are measured, so a balance may still differ between runs when several splits are
    almost as fast: save the balance with the model's state, and reuse it to resume or
    deploy, rather than balancing again::

        torch.save({"balance": model.balance, "model": model.state_dict()}, path)

    The model is not changed: layers are profiled on copies, and the random number
    generator states are restored.

    Args:
        partitions: the number of partitions, from 1 to the number of layers.
        module: the model to split.
        sample: the first layer's arguments, of any batch size (one micro-batch's gives
            the most faithful times): a tensor is its one argument, a tuple its positional
            arguments (``layer(*sample)``), a dict its keyword arguments
            (``layer(**sample)``); a tuple or a dict the first layer takes as one argument
            goes in a one-element tuple, ``(pair,)``. Tensors may sit inside tuples, lists
            and dicts. Later layers get the previous layer's output as one argument.
        timeout: seconds to keep repeating the measurements for, counted from the start;
            ``0`` runs the warm-up and the minimum passes only. None (the default): for 1 s,
            or until the minimum passes are done if they take longer (without a warning).
        passes: the smallest number of measured passes (default 5), run even when they
            take longer than ``timeout``.
        device: the device to profile on; by default the device of ``sample``, which must be
            on ``device`` when both are given.
        progress: show a progress bar: True, False, or None (the default) for a bar on
            standard error when it is a terminal and profiling takes more than a second.

    Returns:
        The number of layers in each partition, for ``GPipe(module, balance)``.

    Raises:
        BalanceError: ``partitions`` is not a positive integer or exceeds the number of
            layers.
        TypeError: ``module`` is not ``nn.Sequential``, ``sample`` is not a tensor, a tuple
            or a dict holding a tensor, or the first layer's ``forward`` does not take the
            arguments it stands for (the message names the sample's form and what to pass).
        ValueError: ``sample`` is not on ``device``, ``timeout`` is negative or not finite,
            or ``passes`` is not a positive integer.

    Warns:
        UserWarning: a positive ``timeout`` was given and the warm-up and the minimum
            ``passes`` took longer than it (the warning names the timeout and the passes done); see
            :func:`~gpipe_balance.profile_times`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> balance = balance_by_time(2, model, torch.randn(8, 16), timeout=0.1)
        >>> len(balance), sum(balance)
        (2, 3)

        A first layer with several inputs takes them as a tuple, or as a dict of keywords:

        >>> class Embed(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.table = nn.Embedding(10, 16)
        ...
        ...     def forward(self, ids, attention_mask):
        ...         return self.table(ids) * attention_mask.unsqueeze(-1)
        >>> model = nn.Sequential(Embed(), nn.Linear(16, 16), nn.Linear(16, 4))
        >>> ids, mask = torch.randint(10, (8, 5)), torch.ones(8, 5)
        >>> len(balance_by_time(2, model, (ids, mask), timeout=0))
        2
        >>> len(balance_by_time(2, model, {"ids": ids, "attention_mask": mask}, timeout=0))
        2
    """
    module = check_module(module)
    check_partitions(partitions, len(module))
    times = _profile_times(
        module,
        sample,
        timeout=timeout,
        passes=passes,
        device=device,
        progress=progress,
        stacklevel=3,
    )
    return solve(times, partitions)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Sample,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device | None = None,
    progress: bool | None = None,
) -> list[int]:
    """A balance of ``module`` into ``partitions`` partitions that evens out memory.

    Every layer's training memory is measured (:func:`~gpipe_balance.profile_sizes`): the
    activations it keeps for backward for one micro-batch of ``input`` split into
    ``chunks``, plus its parameters times ``param_scale``, plus its buffers. Then
    :func:`~gpipe_balance.solve` returns the split whose fullest partition is as small as
    possible. It works on every device, CPU included.

    The model is not changed: layers are profiled on copies, and the random number
    generator states are restored.

    Args:
        partitions: the number of partitions, from 1 to the number of layers.
        module: the model to split.
        input: a mini-batch of the size used in training, as the first layer takes it: a
            tensor, a tuple of positional arguments or a dict of keyword arguments (see
            :func:`balance_by_time`). Its tensors are split into ``chunks`` along dimension
            0; :class:`~gpipe_microbatch.NoChunk` tensors and other values are passed whole.
        chunks: the number of micro-batches in training (default 1).
        param_scale: how many copies of the parameters training keeps: 2 for parameters
            and gradients (the default), more for optimizers with state (see the guide).
        device: the device to profile on; by default the device of ``input``, which must be
            on ``device`` when both are given.
        progress: show a progress bar: True, False, or None (the default) for a bar on
            standard error when it is a terminal and profiling takes more than a second.

    Returns:
        The number of layers in each partition, for ``GPipe(module, balance)``.

    Raises:
        BalanceError: ``partitions`` is not a positive integer or exceeds the number of
            layers.
        TypeError: ``module`` is not ``nn.Sequential``, ``input`` is not a tensor, a tuple
            or a dict holding a tensor, or the first layer's ``forward`` does not take the
            arguments it stands for.
        ValueError: ``input`` is not on ``device``, ``chunks`` is not a positive integer,
            ``param_scale`` is negative or not finite, or the tensors to split have
            different batch sizes.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        >>> balance_by_size(2, model, torch.randn(32, 16), chunks=4, param_scale=4.0)
        [2, 2]
    """
    module = check_module(module)
    check_partitions(partitions, len(module))
    sizes = profile_sizes(
        module, input, chunks=chunks, param_scale=param_scale, device=device, progress=progress
    )
    return solve(sizes, partitions)
