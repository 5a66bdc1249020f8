"""Decode runs across processes (``GPipe.decode`` with ``group=``): the plain model's
outputs lane by lane on every rank, a step after them, and no hang when a rank dies or the
ranks disagree."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_core import Lanes


def plain_outputs(
    cases: ModuleType, balance: list[int], chunks: int, rounds: int, stops: list[int]
) -> dict[tuple[int, int], list[list[float]]]:
    plain = cases.cached_model(0, sum(balance))
    feedback, store = cases.Halving(stops), Lanes()
    for lane, value in enumerate(cases.decode_input(1, 2 * chunks).chunk(chunks)):
        inputs = value
        for round in range(rounds):
            with store.lane(lane), torch.no_grad():
                inputs = feedback(lane, round, plain(inputs))
            if inputs is None:
                break
    return feedback.outputs


@pytest.mark.parametrize(
    ("balance", "chunks", "stops"), [([2, 2], 1, [4]), ([1, 3], 2, [4, 2]), ([3, 1], 3, [1, 4, 3])]
)
def test_decode_across_ranks_matches_the_plain_model(
    cluster2: Any, cases: ModuleType, balance: list[int], chunks: int, stops: list[int]
) -> None:
    results = cluster2.results("decode", balance=balance, chunks=chunks, rounds=4, stops=stops)
    expected = plain_outputs(cases, balance, chunks, 4, stops)
    plain = cases.cached_model(0, sum(balance))
    x, y = cases.data(0, 4)
    loss = nn.MSELoss()(plain(x), y).item()
    for rank, result in enumerate(results):
        assert result["outputs"].keys() == expected.keys(), rank
        for key, value in expected.items():
            torch.testing.assert_close(
                torch.tensor(result["outputs"][key]), torch.tensor(value), rtol=1e-12, atol=1e-12
            )
        assert abs(result["reduced"] - loss) < 1e-12, (rank, result["reduced"], loss)


def test_a_dying_rank_fails_the_others_mid_decode(new_cluster: Callable[[int], Any]) -> None:
    cluster = new_cluster(2)
    replies = cluster.run("decode_die", dying_rank=1, timeout=90)
    assert replies[1][0] == "gone"
    status, result = replies[0][0], replies[0][1]
    assert status == "ok", replies[0]
    assert result["type"] == "RemotePartitionError", result
    assert "rank 1" in result["message"] and "died" in result["message"], result


def test_ranks_that_disagree_on_a_decode_are_refused_alike(cluster2: Any) -> None:
    results = cluster2.results("decode_disagree", odd_rank=1)
    for result in results:
        assert result["rounds"]["type"] == "RanksDisagree", result
        assert "rounds" in result["rounds"]["message"], result
        assert result["agree"]["type"] == "RanksDisagree", result
        assert "options" in result["agree"]["message"], result
    assert results[0]["outputs"] == results[1]["outputs"] and results[0]["outputs"]
