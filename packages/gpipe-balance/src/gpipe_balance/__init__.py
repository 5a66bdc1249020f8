"""Automatic balancing: split an ``nn.Sequential`` into partitions of even cost.

* :func:`solve`: the exact partition solver for a list of per-layer costs.
* :func:`balance_by_time` and :func:`balance_by_size`: profile a model on a sample and
  solve for the balance by time or by memory; :func:`profile_times` and
  :func:`profile_sizes` return the per-layer costs themselves.

It needs neither gpipe-core nor a GPU.

Example:
    >>> from gpipe_balance import solve
    >>> solve([1.0, 3.0, 2.0, 2.0], partitions=2)
    [2, 2]
"""

from .__about__ import __version__
from .errors import BalanceError
from .solver import block_costs, solve

__all__ = ["BalanceError", "__version__", "block_costs", "solve"]
