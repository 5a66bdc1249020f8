"""The public names of gpipe_checkpoint: a change to them is deliberate (see CHANGELOG.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import gpipe_checkpoint

NAMES = [
    "Checkpoint",
    "Checkpointing",
    "RNGStates",
    "__version__",
    "checkpoint",
    "device_rng_lock",
    "enable_checkpointing",
    "enable_recomputing",
    "gradients",
    "is_checkpointing",
    "is_differentiable",
    "is_recomputing",
    "replay_rng_states",
    "restore_rng_states",
    "rng_moved",
    "run_backward",
    "save_rng_states",
]


def test_public_names(public_names: Callable[[ModuleType, list[str], list[str]], None]) -> None:
    # Every module of the package is an implementation module (_name.py).
    public_names(gpipe_checkpoint, NAMES, [])


def test_checkpoint_is_the_function() -> None:
    # Before the modules were private, gpipe_checkpoint.checkpoint could have meant a module.
    assert callable(gpipe_checkpoint.checkpoint)
    assert gpipe_checkpoint.checkpoint.__name__ == "checkpoint"
