"""Hugging Face causal language models as pipelines: ``gpipe.transformers.pipeline(model)``.

The names are those of :mod:`gpipe_transformers`, re-exported. This module is imported only
when it is used (``import gpipe`` does not import it, nor ``transformers``); it needs the
``transformers`` extra: ``pip install "gpipe[transformers]"`` with the wheels.

Example:
    >>> import torch
    >>> import gpipe.transformers
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(
    ...     vocab_size=64,
    ...     hidden_size=16,
    ...     intermediate_size=32,
    ...     num_hidden_layers=2,
    ...     num_attention_heads=2,
    ... )
    >>> model = LlamaForCausalLM(config)
    >>> pipe = gpipe.transformers.pipeline(model, balance=[1, 1], chunks=2)
    >>> ids = torch.randint(64, (4, 8))
    >>> pipe(input_ids=ids).shape
    torch.Size([4, 8, 64])
"""

from gpipe_transformers import (
    CausalLMPipe,
    LayoutError,
    from_pretrained,
    pipeline,
    save_pretrained,
    sequence,
)

__all__ = [
    "CausalLMPipe",
    "LayoutError",
    "from_pretrained",
    "pipeline",
    "save_pretrained",
    "sequence",
]
