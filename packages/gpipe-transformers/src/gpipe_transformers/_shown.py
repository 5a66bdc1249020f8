"""How the package's error messages show a value the caller gave: a tensor by its shape and
dtype, a module by its type, anything else by a repr cut to one short line.

It must not know pipelines or models.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["shown"]


def shown(value: object) -> str:
    """``value`` as an error message shows it.

    Example:
        >>> import torch
        >>> shown(torch.zeros(2, 3)), shown(nn.Linear(2, 2)), shown("x" * 100)[-5:]
        ('tensor of shape (2, 3), torch.float32', 'a Linear', 'xx...')
    """
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}, {value.dtype}"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    text = repr(value)
    if "\n" in text:
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else f"{text[:77]}..."
