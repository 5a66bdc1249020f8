"""Activation checkpointing in two phases, with random draws replayed exactly.

* :func:`checkpoint`: checkpoint one function call, without a pipeline.
* :class:`Checkpointing`: the checkpoint and recompute phases, for a scheduler to place.
* :func:`is_checkpointing`, :func:`is_recomputing`: which phase a layer runs in;
  :func:`enable_checkpointing`, :func:`enable_recomputing` set them for a pipeline that
  runs the phases itself.
* :func:`save_rng_states`, :func:`restore_rng_states` and :class:`RNGStates`: CPU and CUDA
  generator states; :func:`rng_moved`: whether a draw happened since states were saved;
  :func:`device_rng_lock`: the lock threads hold to keep their random
  draws replayable.

Example:
    >>> import torch
    >>> from gpipe_checkpoint import checkpoint
    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> checkpoint(layer, x).sum().backward()
    >>> x.grad is not None
    True
"""

from .__about__ import __version__
from ._checkpoint import (
    Checkpoint,
    Checkpointing,
    checkpoint,
    gradients,
    is_differentiable,
    run_backward,
)
from ._phase import enable_checkpointing, enable_recomputing, is_checkpointing, is_recomputing
from ._rng import (
    RNGStates,
    device_rng_lock,
    replay_rng_states,
    restore_rng_states,
    rng_moved,
    save_rng_states,
)

__all__ = [
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
