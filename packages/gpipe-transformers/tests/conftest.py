"""The gpipe-transformers tests' fixtures. What test modules share otherwise they import
from the :mod:`hf_support` package beside this file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    """Every test in float64, where the pipeline's numbers must equal the model's (the
    ranks' processes set it themselves)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture(scope="session", autouse=True)
def _rank_processes() -> Iterator[None]:
    """The ranks that :func:`hf_support.ranks.run` keeps for the session, stopped and reaped
    at its end."""
    yield
    from hf_support.ranks import close_all

    close_all()
