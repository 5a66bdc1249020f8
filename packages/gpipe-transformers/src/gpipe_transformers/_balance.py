"""How a causal LM's decoder layers are split into a pipeline's partitions: how many
partitions there are (:func:`partition_count`) and the balance of its sequence of pieces
(:func:`sequence_balance`: the embeddings with the first partition, the head with the last).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["partition_count", "sequence_balance"]


def _even(layers: int, parts: int) -> list[int]:
    share, extra = divmod(layers, parts)
    return [share + (k < extra) for k in range(parts)]


def partition_count(
    devices: Sequence[Any] | None,
    group: dist.ProcessGroup | None,
    placement: object,
    mesh: DeviceMesh | None = None,
) -> int:
    """How many partitions a pipeline has: one per device, rank of ``group`` or of
    ``mesh["pp"]``, two with ``placement="loop"`` or ``"v"``, or the placement's own."""
    if isinstance(placement, Sequence) and not isinstance(placement, str):
        return len(placement)
    pp = _pp_size(mesh)
    workers = (
        pp if pp is not None
        else group.size() if group is not None
        else len(devices) if devices is not None
        else 1
    )  # fmt: skip
    return workers * 2 if placement in ("loop", "v") else workers


def _pp_size(mesh: object) -> int | None:
    """The size of ``mesh``'s ``"pp"`` dimension (None: no such mesh; GPipe refuses it)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["pp"].size() if isinstance(mesh, DeviceMesh) and "pp" in names else None


def sequence_balance(balance: object, layers: int, parts: int, name: str) -> list[int]:
    """The sequence's balance for ``balance`` decoder layers per partition (None: even)."""
    if balance is None:
        if parts > layers:
            raise ValueError(
                f"a pipeline of {parts} partitions needs at least {parts} decoder layers; "
                f"give balance, or fewer devices or ranks (model: {name}, decoder layers: "
                f"{layers})"
            )
        counts = _even(layers, parts)
    else:
        if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
            raise TypeError(f"balance must be a sequence of ints (balance: {balance!r})")
        counts = list(balance)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError(f"balance must hold non-negative ints (balance: {counts})")
        if sum(counts) == layers + 2:
            return counts  # the sequence's own balance (balance_by_time's)
        if sum(counts) != layers:
            raise ValueError(
                "balance counts decoder layers per partition and must sum to the model's "
                f"{layers} decoder layers (balance: {counts}, sum: {sum(counts)}; a balance "
                f"of the whole sequence sums to {layers + 2})"
            )
    if not all(counts[1:-1]):
        raise ValueError(
            "balance must give every partition but the first and the last a decoder layer "
            f"(the first holds the embeddings, the last the head) (balance: {counts})"
        )
    counts = list(counts)
    counts[0] += 1
    counts[-1] += 1
    return counts
