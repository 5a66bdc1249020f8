"""Carry the caller's autograd and autocast state into another thread.

Grad mode, inference mode, autocast and the default saved-tensor hooks are thread-local
in PyTorch. Work handed to a worker thread (or re-run later by autograd) must see the
state of the thread that asked for it, or ``with torch.autocast(...)``,
``with torch.no_grad()`` and ``with torch.autograd.graph.saved_tensors_hooks(...)``
silently stop at the thread boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ThreadState"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

# The (pack, unpack) pair of the innermost ``saved_tensors_hooks`` block, or None.
_Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


def _saved_tensors_hooks() -> _Hooks:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@dataclass(frozen=True)
class ThreadState:
    """A snapshot of the thread-local state that computation depends on.

    Example:
        >>> with torch.no_grad():
        ...     state = ThreadState.capture()
        >>> with state.apply():
        ...     torch.is_grad_enabled()
        False
    """

    grad_enabled: bool
    inference_mode: bool
    #: ``(device_type, enabled, dtype)`` of autocast for each device type.
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    #: The innermost ``torch.autograd.graph.saved_tensors_hooks`` pair, or None.
    saved_tensors_hooks: _Hooks = None

    @classmethod
    def capture(cls) -> ThreadState:
        """The state of the calling thread."""
        autocast = tuple(
            (
                device_type,
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
            )
            for device_type in _AUTOCAST_DEVICE_TYPES
        )
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            saved_tensors_hooks=_saved_tensors_hooks(),
        )

    @contextmanager
    def apply(self) -> Generator[None, None, None]:
        """Run the body under this state, in whatever thread calls it.

        Autocast is set for every device type, on or off as captured, so a state
        captured without autocast also turns off an autocast region the body runs in.
        Captured saved-tensor hooks are pushed unless they are already the innermost ones;
        a state captured without hooks leaves the body's hooks as they are.
        """
        with ExitStack() as stack:
            if self.inference_mode != torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(self.inference_mode))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, enabled, dtype in self.autocast:
                if (
                    torch.is_autocast_enabled(device_type) == enabled
                    and (not enabled or torch.get_autocast_dtype(device_type) == dtype)
                    and torch.is_autocast_cache_enabled() == self.autocast_cache
                ):
                    continue
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache
                    )
                )
            hooks = self.saved_tensors_hooks
            if hooks is not None and _saved_tensors_hooks() != hooks:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
            yield
