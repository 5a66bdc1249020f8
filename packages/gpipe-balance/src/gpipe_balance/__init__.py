"""Automatic balancing: split an ``nn.Sequential`` into partitions of even cost.

* :func:`balance_by_time` and :func:`balance_by_size`: profile a model on a sample and
  return the balance that evens out compute time or memory.
* :func:`profile_times` and :func:`profile_sizes`: the per-layer costs themselves.
* :func:`solve`: the exact partition solver for any list of per-layer costs, and
  :func:`block_costs` to see the cost of every partition of a balance.
* :exc:`BalanceError`: what they raise for a number of partitions or costs that no split
  can have; the very class :exc:`gpipe_microbatch.BalanceError`, which ``GPipe`` raises too.

It needs neither gpipe-core nor a GPU.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe_balance import balance_by_size, solve
    >>> solve([1.0, 3.0, 2.0, 2.0], partitions=2)
    [2, 2]
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    >>> balance_by_size(2, model, torch.randn(16, 8))
    [1, 3]
"""

from gpipe_microbatch import BalanceError

from .__about__ import __version__
from ._balance import balance_by_size, balance_by_time
from ._profile import profile_sizes, profile_times
from ._solver import block_costs, solve

__all__ = [
    "BalanceError",
    "__version__",
    "balance_by_size",
    "balance_by_time",
    "block_costs",
    "profile_sizes",
    "profile_times",
    "solve",
]
