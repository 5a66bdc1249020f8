"""gpipe.transformers: the same objects as gpipe_transformers, imported only when used."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

import gpipe
import gpipe_transformers

NAMES = [
    "CausalLMPipe",
    "LayoutError",
    "from_pretrained",
    "pipeline",
    "save_pretrained",
    "sequence",
]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter, with this one's import path."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                          timeout=120, check=False)  # fmt: skip


def test_every_name_is_the_same_object() -> None:
    import gpipe.transformers

    assert gpipe.transformers.__all__ == NAMES
    assert sorted(set(gpipe_transformers.__all__) - {"__version__"}) == NAMES
    for name in NAMES:
        assert getattr(gpipe.transformers, name) is getattr(gpipe_transformers, name), name


def test_import_gpipe_imports_neither_gpipe_transformers_nor_transformers() -> None:
    code = (
        "import sys, gpipe\n"
        "print(sorted(m for m in ('transformers', 'gpipe_transformers', 'gpipe.transformers')"
        " if m in sys.modules))\n"
        "print('transformers' in dir(gpipe), 'transformers' in gpipe.__all__)\n"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "True False"]


def test_gpipe_transformers_is_imported_on_first_use() -> None:
    code = (
        "import sys, gpipe\n"
        "pipeline = gpipe.transformers.pipeline\n"
        "print(pipeline.__module__, 'gpipe.transformers' in sys.modules)\n"
        "import gpipe.transformers as t\n"
        "print(t is gpipe.transformers)\n"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["gpipe_transformers._pipeline", "True", "True"]


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        gpipe.no_such_module  # noqa: B018
    except AttributeError as error:
        assert "no_such_module" in str(error)
    else:
        raise AssertionError("gpipe.no_such_module did not raise")


def test_facade_lists_names_explicitly() -> None:
    import gpipe.transformers

    assert gpipe.transformers.__file__ is not None
    tree = ast.parse(Path(gpipe.transformers.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert all(alias.name != "*" for alias in node.names), ast.unparse(node)


def test_pipeline_through_the_facade_matches_the_model() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import gpipe.transformers

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(32, (4, 6))
    expected = model(input_ids=ids).logits
    pipe = gpipe.transformers.pipeline(model, balance=[1, 1], chunks=2)
    assert isinstance(pipe, gpipe.GPipe)
    torch.testing.assert_close(pipe(input_ids=ids), expected, rtol=0, atol=1e-12)
