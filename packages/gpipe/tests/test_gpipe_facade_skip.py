"""Tests of the gpipe.skip facade: every name is the gpipe_skip object itself."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

import gpipe
import gpipe.skip
import gpipe_skip


def test_every_name_is_the_same_object() -> None:
    assert gpipe.skip.__all__
    assert len(gpipe.skip.__all__) == len(set(gpipe.skip.__all__))
    for name in gpipe.skip.__all__:
        assert getattr(gpipe.skip, name) is getattr(gpipe_skip, name), name


def test_user_api_is_exported() -> None:
    for name in (
        "skippable",
        "stash",
        "pop",
        "Namespace",
        "Skippable",
        "verify_skippables",
        "inspect_skip_layout",
    ):
        assert name in gpipe.skip.__all__, name


def test_skip_is_an_attribute_of_gpipe() -> None:
    assert gpipe.skip is gpipe.__dict__["skip"]
    assert "skip" in gpipe.__all__


def test_facade_lists_names_explicitly() -> None:
    source = Path(gpipe.skip.__file__).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert all(alias.name != "*" for alias in node.names), ast.unparse(node)


def test_a_skip_through_the_facade() -> None:
    @gpipe.skip.skippable(stash=["skip"])
    class Save(nn.Module):
        def forward(self, x):
            yield gpipe.skip.stash("skip", x)
            return x * 2

    @gpipe.skip.skippable(pop=["skip"])
    class Add(nn.Module):
        def forward(self, x):
            return x + (yield gpipe.skip.pop("skip"))

    model = gpipe.GPipe(nn.Sequential(Save(), nn.Identity(), Add()), balance=[1, 1, 1], chunks=2)
    x = torch.ones(4, requires_grad=True)
    out = model(x)
    torch.testing.assert_close(out, torch.full((4,), 3.0))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))
    assert [r.pop_partition for r in model.skip_layout.crossing()] == [2]
