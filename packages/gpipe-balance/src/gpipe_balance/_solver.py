"""The partition solver: contiguous blocks whose largest cost is as small as possible."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from fractions import Fraction
from numbers import Rational, Real

from gpipe_microbatch import BalanceError, check_balance

__all__ = ["block_costs", "check_partitions", "solve"]


def check_partitions(partitions: object, layers: int) -> int:
    """Check that ``partitions`` blocks can be cut from ``layers`` layers; returns it.

    Raises:
        BalanceError: ``partitions`` is not a positive integer (booleans are refused too), or
            is larger than ``layers``.
    """
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise BalanceError(f"partitions must be a positive integer (partitions: {partitions!r})")
    if partitions > layers:
        raise BalanceError(
            "partitions must not exceed the number of layers "
            f"(partitions: {partitions}, layers: {layers})"
        )
    return partitions


def _exact(costs: object) -> list[Fraction]:
    """``costs`` as exact rationals, after checking each one."""
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(f"costs must be a sequence of numbers (costs: {type(costs).__name__})")
    exact: list[Fraction] = []
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, Real):
            raise TypeError(f"costs must be real numbers (costs[{index}]: {type(cost).__name__})")
        finite = isinstance(cost, Rational) or math.isfinite(cost)
        if not finite or cost < 0:
            raise BalanceError(f"costs must be finite and non-negative (costs[{index}]: {cost!r})")
        exact.append(Fraction(cost) if isinstance(cost, Rational) else Fraction(float(cost)))
    return exact


def _scaled(costs: object) -> list[int]:
    """``costs`` times one common positive factor, as integers: exact sums and comparisons.

    Every float is a fraction whose denominator is a power of two, so the factor (the least
    common multiple of the denominators) exists, and the order of every pair of sums of the
    scaled costs is the order of the same sums of the real costs.
    """
    exact = _exact(costs)
    factor = math.lcm(1, *(cost.denominator for cost in exact))
    return [cost.numerator * (factor // cost.denominator) for cost in exact]


def block_costs(costs: Iterable[float], balance: Iterable[int]) -> list[float]:
    """The cost of every block of ``balance``: the sum of the costs of its layers.

    Example:
        >>> block_costs([1.0, 2.0, 3.0, 4.0], [2, 2])
        [3.0, 7.0]

    Raises:
        BalanceError: ``balance`` has a count that is not a positive integer, or does not
            sum to the number of costs.
    """
    values = [float(cost) for cost in costs]
    counts = check_balance(balance, len(values))
    result: list[float] = []
    start = 0
    for count in counts:
        result.append(math.fsum(values[start : start + count]))
        start += count
    return result


def _blocks_needed(prefix: list[int], bound: int, limit: int) -> int:
    """Blocks of cost at most ``bound`` that greedy packing needs (stops past ``limit``).

    ``bound`` must be at least the largest single cost.
    """
    layers = len(prefix) - 1
    count = 0
    start = 0
    while start < layers and count <= limit:
        # The furthest end whose block still fits; costs are non-negative, so the prefix sums
        # are sorted and one bisection finds it.
        start = bisect_right(prefix, prefix[start] + bound) - 1
        count += 1
    return count


def _smallest_bottleneck(costs: list[int], prefix: list[int], partitions: int) -> int:
    """The smallest largest-block cost over every split into ``partitions`` blocks.

    A bound is achievable with exactly ``partitions`` non-empty blocks if and only if greedy
    packing needs at most that many blocks: cutting a block in two never raises the largest
    cost, and there are at least as many layers as partitions. Costs are integers here, so a
    binary search over integers finds the bound exactly.
    """
    low = max(max(costs), -(-prefix[-1] // partitions))
    high = prefix[-1]
    while low < high:
        middle = (low + high) // 2
        if _blocks_needed(prefix, middle, partitions) <= partitions:
            high = middle
        else:
            low = middle + 1
    return low


def _largest_smallest_block(prefix: list[int], partitions: int, bottleneck: int) -> int:
    """The largest smallest-block cost among splits whose blocks all cost at most ``bottleneck``.

    Dynamic programming over (blocks, layers): ``best[i]`` is the best smallest-block cost
    of the first ``i`` layers cut into ``j`` blocks, or None where no such cut exists.
    """
    layers = len(prefix) - 1
    best: list[int | None] = [None] * (layers + 1)
    best[0] = prefix[-1] + 1  # no block yet: larger than any block cost
    for j in range(1, partitions + 1):
        current: list[int | None] = [None] * (layers + 1)
        for i in range(j, layers - (partitions - j) + 1):
            # Blocks (s, i] cost prefix[i] - prefix[s]: at most the bottleneck from here on.
            first = max(bisect_left(prefix, prefix[i] - bottleneck), j - 1)
            value: int | None = None
            for s in range(first, i):
                before = best[s]
                if before is None:
                    continue
                candidate = min(before, prefix[i] - prefix[s])
                if value is None or candidate > value:
                    value = candidate
            current[i] = value
        best = current
    result = best[layers]
    assert result is not None, "the bottleneck admits a split"
    return result


def _most_even_split(prefix: list[int], partitions: int, floor: int, ceiling: int) -> list[int]:
    """The split with block costs in [floor, ceiling] and the smallest sum of squared costs.

    Among equal sums, the lexicographically smallest balance. ``rest[j][i]`` is the smallest
    sum of squares for layers ``i:`` cut into ``j`` blocks (None where impossible); the
    balance is then rebuilt from the front, taking the shortest first block that is optimal.
    """
    layers = len(prefix) - 1

    def ends(i: int, j: int) -> range:
        # Ends e of a first block (i, e] among j blocks of layers i: with a cost in range.
        low = max(bisect_left(prefix, prefix[i] + floor), i + 1)
        high = min(bisect_right(prefix, prefix[i] + ceiling) - 1, layers - (j - 1))
        return range(low, high + 1)

    rest: list[list[int | None]] = [[None] * (layers + 1) for _ in range(partitions + 1)]
    rest[0][layers] = 0
    for j in range(1, partitions + 1):
        for i in range(layers - j, -1, -1):
            value: int | None = None
            for e in ends(i, j):
                after = rest[j - 1][e]
                if after is None:
                    continue
                candidate = (prefix[e] - prefix[i]) ** 2 + after
                if value is None or candidate < value:
                    value = candidate
            rest[j][i] = value

    balance: list[int] = []
    i = 0
    for j in range(partitions, 0, -1):
        target = rest[j][i]
        assert target is not None, "the floor and ceiling admit a split"
        for e in ends(i, j):
            after = rest[j - 1][e]
            if after is not None and (prefix[e] - prefix[i]) ** 2 + after == target:
                balance.append(e - i)
                i = e
                break
    return balance


def solve(costs: Iterable[float], partitions: int) -> list[int]:
    """Cut a sequence of layer costs into contiguous blocks with the smallest bottleneck.

    The cost of a block is the sum of the costs of its layers, and the bottleneck of a split
    is its largest block cost: the time of the slowest pipeline stage, or the memory of the
    fullest device. Among all ways to cut ``costs`` into ``partitions`` contiguous,
    non-empty blocks, ``solve`` returns the first in this order:

    1. the smallest bottleneck. This is exact: no split of these costs into this many blocks
       has a smaller largest block.
    2. then the largest smallest block. Every split that reaches the optimal bottleneck has
       that bottleneck as its largest block, so this minimizes the *spread*, the largest
       block cost minus the smallest.
    3. then the smallest sum of squared block costs: the block costs are as even as they can
       be (the sum of the costs is fixed, so this is the smallest variance).
    4. then the smallest balance in lexicographic order (earlier blocks take fewer layers),
       so the answer is unique and deterministic.

    Block costs are summed and compared exactly: each cost is converted to an exact rational
    number (every float is one), so ties are true ties, never rounding artifacts, and the
    order of the costs' summation does not matter.

    The algorithm: a binary search for the bottleneck with a greedy feasibility check, then
    two dynamic programs over (layers, blocks) restricted to blocks within the bottleneck.
    The work grows like ``partitions * layers * w``, where ``w`` is the most layers that fit
    in one block, so a few hundred layers take a fraction of a second.

    Args:
        costs: the cost of every layer, in order: finite and non-negative real numbers.
        partitions: the number of blocks, from 1 to the number of layers.

    Returns:
        The balance: the number of layers in each block, every one positive, summing to
        ``len(costs)``. It can be passed to ``GPipe(module, balance)``.

    Raises:
        BalanceError: ``partitions`` is not a positive integer or exceeds the number of
            costs, or a cost is negative, infinite or NaN.
        TypeError: ``costs`` is not a sequence of real numbers.

    Example:
        >>> solve([1, 1, 1, 1, 2, 2], partitions=5)
        [1, 1, 2, 1, 1]
        >>> solve([4.0, 1.0, 1.0, 1.0, 1.0], partitions=2)
        [1, 4]
    """
    scaled = _scaled(costs)
    layers = len(scaled)
    partitions = check_partitions(partitions, layers)
    if partitions == 1:
        return [layers]
    if partitions == layers:
        return [1] * layers
    prefix = [0]
    for cost in scaled:
        prefix.append(prefix[-1] + cost)
    if prefix[-1] == 0:
        # Every block costs nothing: all splits tie, and the smallest balance comes first.
        return [1] * (partitions - 1) + [layers - partitions + 1]
    bottleneck = _smallest_bottleneck(scaled, prefix, partitions)
    floor = _largest_smallest_block(prefix, partitions, bottleneck)
    return _most_even_split(prefix, partitions, floor, bottleneck)
