"""Automatic balancing: ``gpipe.balance`` re-exports :mod:`gpipe_balance`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe import GPipe
    >>> from gpipe.balance import balance_by_time
    >>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    >>> balance = balance_by_time(2, model, torch.randn(16, 8), timeout=0.1)
    >>> model = GPipe(model, balance, chunks=4)
"""

from gpipe_balance import (
    BalanceError,
    balance_by_size,
    balance_by_time,
    block_costs,
    profile_sizes,
    profile_times,
    solve,
)

__all__ = [
    "BalanceError",
    "balance_by_size",
    "balance_by_time",
    "block_costs",
    "profile_sizes",
    "profile_times",
    "solve",
]
