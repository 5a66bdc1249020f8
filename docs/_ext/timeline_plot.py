"""Sphinx extension: draw the timeline of a real pipeline run for the docs.

When the build starts, a small GPipe runs on the CPU under ``model.trace()``; its plot is
saved to ``_generated/timeline.png`` and its summary to ``_generated/timeline_summary.txt``,
which ``timeline.rst`` includes. The files are rebuilt on every build and not tracked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)


def _generate(app: Sphinx) -> None:
    import torch
    from torch import nn

    from gpipe_core import GPipe

    out = Path(app.srcdir) / "_generated"
    out.mkdir(exist_ok=True)
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        width, partitions, chunks = 512, 4, 8
        layers: list[nn.Module] = []
        for _ in range(partitions):
            layers += [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh()]
        model = GPipe(nn.Sequential(*layers), [4] * partitions, chunks=chunks)
        x = torch.randn(chunks * 128, width)
        for _ in range(2):  # warm up: start the workers, allocate
            model(x).sum().backward()
        with model.trace() as timeline:
            model(x).sum().backward()
        timeline.plot(out / "timeline.png")
        (out / "timeline_summary.txt").write_text(str(timeline.summary()) + "\n")
        logger.info("timeline_plot: wrote %s", out / "timeline.png")
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(state)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", _generate)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
