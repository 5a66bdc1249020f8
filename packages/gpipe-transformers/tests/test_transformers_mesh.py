"""A causal LM on a device mesh (``mesh=``): a ``pp`` x ``dp_shard`` mesh of 2 x 2 over four
gloo ranks, each pipeline stage's layers sharded with FSDP2 over two ranks, each stepping on
its half of the batch: the loss and the gathered gradients are the plain model's on the
whole batch over two AdamW steps (a mixture of experts' router loss too);
``save_pretrained`` writes the whole tensors transformers' ``from_pretrained`` reads, and
``from_pretrained(mesh=)`` reads them back."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_support.ranks import run

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []

TOLERANCE = 1e-10
#: transformers sums the router statistics in float32.
ROUTER_TOLERANCE = 1e-6


@pytest.mark.parametrize("router", [False, True], ids=["llama", "mixtral-router-loss"])
def test_a_causal_lm_on_a_mesh_trains_saves_and_loads_as_the_plain_model(
    router: bool, tmp_path: Path
) -> None:
    tolerance = ROUTER_TOLERANCE if router else TOLERANCE
    results = run("mesh_exact", world=4, folder=str(tmp_path), router=router)
    for rank, found in enumerate(results):
        assert max(found["loss"]) <= tolerance, (rank, found)
        assert max(found["grad"]) <= tolerance, (rank, found)
        assert found["saved"] <= tolerance, (rank, found)
        assert found["reloaded off"] <= tolerance, (rank, found)
    # Every replica reloads the same weights and steps on its own half.
    reloaded = [found["reloaded"] for found in results]
    assert reloaded[0] == reloaded[2] and reloaded[1] == reloaded[3], reloaded
