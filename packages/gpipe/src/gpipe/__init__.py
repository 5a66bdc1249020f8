"""GPipe pipeline parallelism for PyTorch.

This is the facade over the gpipe distributions: everything a user needs, under one name.
``gpipe.GPipe``, ``gpipe.NoChunk``, ``gpipe.PipeSequential``, ``gpipe.WithDevice``,
``gpipe.BalanceError``, ``gpipe.RanksDisagree``, ``gpipe.RemotePartitionError`` (also
``gpipe.RemoteStageError``, its former name), ``gpipe.is_checkpointing`` and
``gpipe.is_recomputing`` are here; ``gpipe.skip``, ``gpipe.bn``, ``gpipe.balance``,
``gpipe.timeline`` and ``gpipe.schedule`` re-export the rest, ``gpipe.transformers``
pipelines Hugging Face causal language models (imported when first used, with the
``transformers`` extra), and ``python -m gpipe demo`` runs the demo.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gpipe import GPipe
    >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    >>> model = GPipe(model, balance=[2, 1], chunks=8)
    >>> out = model(torch.randn(128, 64).to(model.devices[0]))
    >>> out.sum().backward()
"""

from gpipe_balance import BalanceError
from gpipe_checkpoint import is_checkpointing, is_recomputing
from gpipe_core import (
    BatchMean,
    GPipe,
    Lanes,
    NoChunk,
    PipeSequential,
    RanksDisagree,
    RemotePartitionError,
    RemoteStageError,
    WithDevice,
    lane_state,
)

from . import balance, bn, schedule, skip, timeline  # the facade modules gpipe.<name>
from .__about__ import __version__

# The facade modules imported when first used, for what they need beyond gpipe's own
# dependencies: gpipe.transformers needs transformers (the extra gpipe[transformers]).
_ON_USE = ("transformers",)

__all__ = [
    "BalanceError",
    "BatchMean",
    "GPipe",
    "Lanes",
    "NoChunk",
    "PipeSequential",
    "RanksDisagree",
    "RemotePartitionError",
    "RemoteStageError",
    "WithDevice",
    "__version__",
    "balance",
    "bn",
    "is_checkpointing",
    "is_recomputing",
    "lane_state",
    "schedule",
    "skip",
    "timeline",
]


def __getattr__(name: str) -> object:
    # gpipe.transformers, imported on first use so that ``import gpipe`` needs no transformers.
    if name in _ON_USE:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_USE})
