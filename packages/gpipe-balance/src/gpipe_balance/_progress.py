"""A progress report for profiling that takes more than a moment."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """A progress bar that appears only once its work has taken ``delay`` seconds.

    It draws with tqdm when tqdm can be imported (``pip install gpipe-balance[progress]``),
    and otherwise rewrites one line of text on ``stream``. By default it is on only when
    ``stream`` is a terminal.

    Args:
        description: what is in progress, shown before the count.
        total: the position at which the work is done.
        unit: the unit of the position, for example ``"layer"`` or ``"s"``.
        enabled: True or False to force the bar on or off; None (the default) shows it when
            ``stream`` is a terminal.
        delay: seconds of work before the bar first appears.
        stream: where to draw; standard error by default.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with Progress("profiling", 3, unit="layer", enabled=True, delay=0, stream=out) as bar:
        ...     bar.update(3)
    """

    def __init__(
        self,
        description: str,
        total: float,
        *,
        unit: str,
        enabled: bool | None = None,
        delay: float = 1.0,
        stream: TextIO | None = None,
    ) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty()) if callable(isatty) else False
        self.enabled = enabled
        self.delay = delay
        self.position: float = 0
        self._start = time.perf_counter()
        self._bar: Any = None
        self._drawn = False

    def _draw(self) -> None:
        if self._bar is None and not self._drawn:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
            except ImportError:
                pass
            else:
                self._bar = tqdm(
                    total=self.total, desc=self.description, unit=self.unit, file=self.stream
                )
        self._drawn = True
        if self._bar is not None:
            self._bar.update(self.position - self._bar.n)
            return
        digits = 0 if isinstance(self.total, int) else 1
        self.stream.write(
            f"\r{self.description}: {self.position:.{digits}f}/{self.total:.{digits}f} {self.unit}"
        )
        self.stream.flush()

    def update(self, position: float) -> None:
        """Move the bar to ``position`` (clamped to ``total``), drawing it once it is due."""
        self.position = min(position, self.total)
        if self.enabled and time.perf_counter() - self._start >= self.delay:
            self._draw()

    def close(self) -> None:
        """Finish the bar's line, if the bar was drawn."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
