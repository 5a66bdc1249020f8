"""What several of gpipe-core's test modules draw from (on the tests' path through the
``pythonpath`` option of pytest's configuration)."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import strategies as st

from core_support.models import MODES, PLANS


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


@st.composite
def batch_mean_specs(draw: st.DrawFn) -> dict[str, Any]:
    """A plan, a balance of the five layers, chunks, a batch with random ignored targets,
    a loss variant and a checkpoint mode."""
    schedule, placement = draw(st.sampled_from(PLANS))
    balance = draw(st.sampled_from(compositions(5, 4 if placement else 2)))
    chunks = draw(st.sampled_from([1, 2, 4]))
    batch = chunks * draw(st.integers(1, 3))
    ignored = [i for i in range(batch) if draw(st.booleans())]
    return {
        "schedule": schedule, "placement": placement, "balance": balance, "chunks": chunks,
        "batch": batch, "ignored": ignored, "seed": draw(st.integers(0, 2**16)),
        "variant": draw(st.sampled_from(["ce", "weighted", "nll"])),
        "checkpoint": draw(st.sampled_from(MODES)),
    }  # fmt: skip
