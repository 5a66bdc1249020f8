"""Tests of the gpipe facade: re-exported names, version, and the README quick start."""

from __future__ import annotations

import ast
import copy
import importlib
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import gpipe
import gpipe_checkpoint
import gpipe_core

# The canonical version pattern from PEP 440, appendix B.
PEP440 = re.compile(
    r"""
    v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_\.]?(?P<pre_l>(a|b|c|rc|alpha|beta|pre|preview))[-_\.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_\.]?(?P<post_l>post|rev|r)[-_\.]?(?P<post_n2>[0-9]+)?))?
    (?P<dev>[-_\.]?(?P<dev_l>dev)[-_\.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_\.][a-z0-9]+)*))?
    """,
    re.VERBOSE | re.IGNORECASE,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_reexports_are_the_same_objects() -> None:
    assert gpipe.GPipe is gpipe_core.GPipe
    assert gpipe.WithDevice is gpipe_core.WithDevice
    assert gpipe.NoChunk is gpipe_core.NoChunk
    assert gpipe.PipeSequential is gpipe_core.PipeSequential
    assert gpipe.BalanceError is gpipe_core.BalanceError
    assert gpipe.is_checkpointing is gpipe_checkpoint.is_checkpointing
    assert gpipe.is_recomputing is gpipe_checkpoint.is_recomputing


def test_balance_error_is_a_value_error() -> None:
    assert issubclass(gpipe.BalanceError, ValueError)
    with pytest.raises(gpipe.BalanceError):
        gpipe.GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), balance=[2, 1])


def test_version() -> None:
    about = importlib.import_module("gpipe.__about__")
    assert isinstance(gpipe.__version__, str)
    assert gpipe.__version__ == about.__version__
    assert PEP440.fullmatch(gpipe.__version__) is not None


def test_version_pattern_rejects_nonsense() -> None:
    # The control for test_version: the pattern is not a match-anything.
    for bad in ("", "one", "1.0-final-final", "1..0"):
        assert PEP440.fullmatch(bad) is None
    for good in ("0.1.0", "1.0rc1", "2!1.0.post2.dev3+local.7"):
        assert PEP440.fullmatch(good) is not None


def test_all_names_exist() -> None:
    assert len(gpipe.__all__) == len(set(gpipe.__all__))
    for name in gpipe.__all__:
        assert hasattr(gpipe, name), name
    for name in ("GPipe", "BalanceError", "is_checkpointing", "is_recomputing", "__version__"):
        assert name in gpipe.__all__


def test_facade_lists_names_explicitly() -> None:
    assert gpipe.__file__ is not None
    source = Path(gpipe.__file__).read_text(encoding="utf-8")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert all(alias.name != "*" for alias in node.names), ast.unparse(node)
    assert "import *" not in source


def test_is_checkpointing_through_the_facade() -> None:
    seen: list[tuple[bool, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((gpipe.is_checkpointing(), gpipe.is_recomputing()))
            return x * 2

    model = gpipe.GPipe(
        nn.Sequential(Probe(), nn.Linear(2, 2)), balance=[1, 1], chunks=1, checkpoint="always"
    )
    out = model(torch.randn(4, 2, requires_grad=True))
    assert seen == [(True, False)]
    out.sum().backward()
    assert seen == [(True, False), (False, True)]
    assert not gpipe.is_checkpointing() and not gpipe.is_recomputing()


def test_quick_start() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    reference = copy.deepcopy(plain)
    model = gpipe.GPipe(plain, balance=[2, 3], chunks=8)
    assert len(model.devices) == 2
    x = torch.randn(128, 64)
    out = model(x.to(model.devices[0]))
    assert out.shape == (128, 10)
    assert out.device == model.devices[-1]
    out.sum().backward()

    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-5)


def test_readme_quick_start_runs() -> None:
    readme = REPO_ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("no repository README next to the packages")
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "the README has no python code block"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(readme), "exec"), namespace)
    model = namespace["model"]
    out = namespace["out"]
    assert isinstance(model, gpipe.GPipe)
    assert isinstance(out, torch.Tensor)
    assert all(p.grad is not None for p in model.parameters())


def test_readme_equivalence_claim_names_its_exceptions() -> None:
    """The README's promise of the plain model's gradients says what batch norm does with
    several micro-batches, and links the page; the numbers below are that exception."""
    readme = REPO_ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("no repository README next to the packages")
    intro = readme.read_text(encoding="utf-8").split("## ", 1)[0]
    assert "gradients are the same as without the pipeline" in intro
    assert "batch norm" in intro and "`chunks > 1`" in intro
    assert "docs/batchnorm.rst" in intro and (REPO_ROOT / "docs" / "batchnorm.rst").is_file()
    assert "BatchMean" in intro
    # The exception is real: each micro-batch normalised on its own.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    pipe = gpipe.GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    assert not torch.allclose(pipe(x), plain(x))
    single = gpipe.GPipe(copy.deepcopy(plain), [2, 1], chunks=1)
    torch.testing.assert_close(single(x), plain(x))
