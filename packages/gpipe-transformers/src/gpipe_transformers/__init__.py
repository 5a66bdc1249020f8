"""Hugging Face causal language models as GPipe pipelines, trained to their own loss."""

from ._layout import LayoutError
from ._pipeline import CausalLMPipe, pipeline, sequence
from .__about__ import __version__

__all__ = ["CausalLMPipe", "LayoutError", "__version__", "pipeline", "sequence"]
