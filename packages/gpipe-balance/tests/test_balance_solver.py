"""The partition solver against brute force, the failure cases of older heuristics, and errors."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe_balance import BalanceError, block_costs, solve


def splits(layers: int, partitions: int) -> list[list[int]]:
    """Every balance: ``partitions`` positive counts summing to ``layers``."""
    result = []
    for cuts in itertools.combinations(range(1, layers), partitions - 1):
        bounds = (0, *cuts, layers)
        result.append([b - a for a, b in itertools.pairwise(bounds)])
    return result


def exact_blocks(costs: list[float], balance: list[int]) -> list[Fraction]:
    exact = [Fraction(c) for c in costs]
    blocks = []
    start = 0
    for count in balance:
        blocks.append(sum(exact[start : start + count], Fraction(0)))
        start += count
    return blocks


def key(costs: list[float], balance: list[int]) -> tuple[object, ...]:
    """The order that solve documents: bottleneck, spread, sum of squares, balance."""
    blocks = exact_blocks(costs, balance)
    return (max(blocks), max(blocks) - min(blocks), sum(b * b for b in blocks), balance)


def brute_force(costs: list[float], partitions: int) -> list[int]:
    return min(splits(len(costs), partitions), key=lambda balance: key(costs, balance))


def check_shape(balance: list[int], layers: int, partitions: int) -> None:
    assert len(balance) == partitions
    assert all(isinstance(count, int) and count >= 1 for count in balance)
    assert sum(balance) == layers


# Small integers make ties (the tie-break's cases) frequent; floats cover rounding.
small_costs = st.lists(st.integers(0, 4).map(float), min_size=1, max_size=9)
float_costs = st.lists(
    st.floats(0, 100, allow_nan=False, allow_infinity=False), min_size=1, max_size=9
)


@st.composite
def instances(draw: st.DrawFn, costs: st.SearchStrategy[list[float]]) -> tuple[list[float], int]:
    values = draw(costs)
    return values, draw(st.integers(1, len(values)))


@settings(max_examples=3000, deadline=None)
@given(instances(small_costs))
def test_matches_brute_force_with_ties(instance: tuple[list[float], int]) -> None:
    costs, partitions = instance
    balance = solve(costs, partitions)
    check_shape(balance, len(costs), partitions)
    assert balance == brute_force(costs, partitions)


@settings(max_examples=2000, deadline=None)
@given(instances(float_costs))
def test_matches_brute_force_with_floats(instance: tuple[list[float], int]) -> None:
    costs, partitions = instance
    balance = solve(costs, partitions)
    check_shape(balance, len(costs), partitions)
    best = brute_force(costs, partitions)
    # The guarantee itself, stated on its own: no split has a smaller bottleneck.
    assert max(exact_blocks(costs, balance)) == max(exact_blocks(costs, best))
    assert balance == best


def test_brute_force_reference_is_not_trivial() -> None:
    # The control: the reference order distinguishes splits, so the tests above can fail.
    costs = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert brute_force(costs, 5) == [1, 1, 2, 1, 1]
    assert key(costs, [2, 1, 1, 1, 1]) > key(costs, [1, 1, 2, 1, 1])
    assert key(costs, [1, 1, 1, 1, 2]) > key(costs, [1, 1, 2, 1, 1])  # bottleneck 4
    assert brute_force([3.0, 1.0, 1.0, 1.0], 2) == [1, 3]
    assert brute_force([1.0, 2.0, 1.0, 2.0, 1.0], 3) == [1, 2, 2]  # blocks 1, 3, 3
    assert brute_force([3.0, 3.0, 1.0, 2.0], 3) == [1, 1, 2]  # 3, 3, 3 beats 3, 4, 2
    # Same bottleneck 4; the spread decides: 4, 2, 3 beats 1, 4, 4 (a smaller balance).
    assert brute_force([1.0, 3.0, 1.0, 1.0, 3.0], 3) == [2, 2, 1]
    assert solve([1.0, 3.0, 1.0, 1.0, 3.0], 3) == [2, 2, 1]


def test_torchgpipe_heuristic_failures() -> None:
    # The block-partition heuristic loops forever on this one; here it ends, with no empty block.
    assert solve([1, 1, 1, 1, 2, 2], 5) == [1, 1, 2, 1, 1]
    # Every count of blocks, on inputs where a heuristic returns empty or crossing blocks.
    for costs in ([1, 1, 1, 1, 2, 2], [5, 0, 0, 0, 0, 5], [0, 0, 0, 0], [1e9, 1, 1e9, 1]):
        for partitions in range(1, len(costs) + 1):
            balance = solve(costs, partitions)
            check_shape(balance, len(costs), partitions)
            assert balance == brute_force([float(c) for c in costs], partitions)


def test_larger_random_instances_are_optimal() -> None:
    # Beyond brute force: compare the bottleneck with an independent exact O(k n^2) program.
    rng = random.Random(5)
    for _ in range(30):
        layers = rng.randint(10, 40)
        costs = [rng.choice([0.0, rng.random(), float(rng.randint(1, 9))]) for _ in range(layers)]
        partitions = rng.randint(1, layers)
        balance = solve(costs, partitions)
        check_shape(balance, layers, partitions)
        exact = [Fraction(c) for c in costs]
        prefix = [Fraction(0), *itertools.accumulate(exact)]
        best = [[math.inf] * (layers + 1) for _ in range(partitions + 1)]
        best[0][0] = Fraction(0)
        for j in range(1, partitions + 1):
            for i in range(j, layers + 1):
                best[j][i] = min(
                    max(best[j - 1][s], prefix[i] - prefix[s]) for s in range(j - 1, i)
                )
        assert max(exact_blocks(costs, balance)) == best[partitions][layers]


def test_exact_sums_decide_ties() -> None:
    # 0.1 + 0.2 is not 0.3 in floating point; exactly, 0.1 + 0.2 > 0.3 as floats are.
    assert solve([0.1, 0.2, 0.3], 2) == [2, 1]
    assert Fraction(0.1) + Fraction(0.2) > Fraction(0.3)


def test_accepts_ints_fractions_and_tuples() -> None:
    assert solve((3, 1, 1, 1), 2) == [1, 3]
    assert solve([Fraction(1, 3), Fraction(1, 3), Fraction(2, 3)], 2) == [2, 1]
    assert solve([10**30, 1, 10**30], 2) == [1, 2]


def test_single_and_every_layer() -> None:
    assert solve([1.0, 2.0, 3.0], 1) == [3]
    assert solve([1.0, 2.0, 3.0], 3) == [1, 1, 1]


def test_deterministic() -> None:
    rng = random.Random(0)
    costs = [rng.choice([1.0, 2.0]) for _ in range(30)]
    assert len({tuple(solve(list(costs), 7)) for _ in range(5)}) == 1


@pytest.mark.parametrize("partitions", [0, -1])
def test_partitions_below_one(partitions: int) -> None:
    message = rf"partitions must be a positive integer \(partitions: {partitions}\)"
    with pytest.raises(BalanceError, match=message):
        solve([1.0, 2.0], partitions)


@pytest.mark.parametrize("partitions", [1.0, "2", True, None])
def test_partitions_not_an_integer(partitions: object) -> None:
    with pytest.raises(BalanceError, match="partitions must be a positive integer"):
        solve([1.0, 2.0], partitions)  # type: ignore[arg-type]


def test_more_partitions_than_layers() -> None:
    with pytest.raises(
        BalanceError,
        match=r"partitions must not exceed the number of layers \(partitions: 3, layers: 2\)",
    ):
        solve([1.0, 2.0], 3)
    with pytest.raises(BalanceError, match="layers: 0"):
        solve([], 1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, -1e-300])
def test_bad_costs(bad: float) -> None:
    with pytest.raises(BalanceError, match=r"costs must be finite and non-negative \(costs\[1\]: "):
        solve([1.0, bad, 2.0], 2)


@pytest.mark.parametrize("costs", [[1.0, "2"], [1.0, None], [True, 1.0], "12", 5])
def test_costs_not_numbers(costs: object) -> None:
    with pytest.raises(TypeError, match="costs must be"):
        solve(costs, 1)  # type: ignore[arg-type]


def test_balance_error_is_a_value_error() -> None:
    assert issubclass(BalanceError, ValueError)
    with pytest.raises(ValueError):
        solve([1.0], 2)


def test_block_costs() -> None:
    assert block_costs([1.0, 2.0, 3.0, 4.0], [1, 3]) == [1.0, 9.0]
    with pytest.raises(BalanceError, match=r"balance must sum to the number of layers"):
        block_costs([1.0, 2.0], [1])
    with pytest.raises(BalanceError, match=r"balance must contain only positive integers"):
        block_costs([1.0, 2.0], [0, 2])
