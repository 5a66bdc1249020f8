"""NoChunk: the mark of a tensor of the input that every micro-batch gets whole.

This module owns the mark alone. It must not know how a mini-batch is split
(:mod:`gpipe_microbatch._scatter` unwraps it) nor the checks that refuse it in an output
(:mod:`gpipe_microbatch._checks`).
"""

from __future__ import annotations

from torch import Tensor

from ._values import type_name

__all__ = ["NoChunk"]


class NoChunk:
    """A tensor of the input that every micro-batch gets whole, rather than a slice of it.

    :func:`scatter` splits the tensors of a mini-batch along dimension 0; a tensor wrapped
    in ``NoChunk`` (an attention mask shared by every sample, a table of positions) is
    unwrapped and passed whole to every micro-batch, as values that are not tensors are.
    Its gradient, if it requires one, is the sum over the micro-batches, as over the
    samples without micro-batches. ``NoChunk`` marks inputs only: the layers see the tensor
    itself, and a layer's output cannot hold a ``NoChunk``.

    Args:
        tensor: the tensor to pass whole (it needs no batch dimension).

    Raises:
        TypeError: ``tensor`` is not a tensor.

    Example:
        >>> from gpipe_microbatch import scatter
        >>> x, scale = torch.ones(4, 2), torch.tensor([1.0, 10.0])
        >>> [batch.values[1] for batch in scatter((x, NoChunk(scale)), chunks=2)]
        [tensor([ 1., 10.]), tensor([ 1., 10.])]
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor (tensor: {type_name(tensor)})")
        #: The wrapped tensor.
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({self.tensor!r})"
