"""What several of gpipe-core's test modules draw from (on the tests' path through the
``pythonpath`` option of pytest's configuration)."""

from __future__ import annotations

import itertools


def compositions(layers: int, parts: int) -> list[list[int]]:
    """Every balance of ``layers`` layers into ``parts`` partitions.

    >>> compositions(4, 2)
    [[1, 3], [2, 2], [3, 1]]
    """
    result = []
    for cuts in itertools.combinations(range(1, layers), parts - 1):
        bounds = [0, *cuts, layers]
        result.append([b - a for a, b in itertools.pairwise(bounds)])
    return result
