"""Hugging Face causal language models as GPipe pipelines, trained to their own loss."""

from .__about__ import __version__
from ._layout import LayoutError
from ._pipeline import CausalLMPipe, pipeline, sequence
from ._pretrained import from_pretrained, save_pretrained

__all__ = [
    "CausalLMPipe",
    "LayoutError",
    "__version__",
    "from_pretrained",
    "pipeline",
    "save_pretrained",
    "sequence",
]
