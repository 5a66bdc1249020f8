"""Where a Hugging Face causal language model keeps its decoder layers: the layout.

A causal LM (``LlamaForCausalLM``) holds a base model (``model.model``, named by its
``base_model_prefix``) and a head (``lm_head``). The base model's configuration describes
its split (``base_model_pp_plan``: the embedding, the decoder layers, the final norm, in
the order its forward calls them); GPT-2's has none and is known here. What runs before the
decoder layers is every other child of the base model (embeddings, rotary position
embeddings, dropout); what runs after them is the plan's modules after the layers, then the
causal LM's own forward with its other children (the head, logit scaling, soft-capping).

It must not know pipelines: it says which modules are where, or refuses a model whose
layout it cannot find, naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Layout", "LayoutError", "find_layout"]

# Families without a pipeline plan whose layout is known: the base model's layer list and
# the modules its forward calls after the layers.
_KNOWN = {"gpt2": ("h", ("ln_f",))}


class LayoutError(ValueError):
    """A model whose decoder layers or pipeline plan cannot be found, or that a pipeline
    cannot train to its own numbers."""


@dataclass(frozen=True)
class Layout:
    """Where a causal LM's parts are."""

    #: The causal LM.
    model: nn.Module
    #: The name of its base model (``model``, or ``transformer`` for GPT-2).
    base_name: str
    #: The name of the base model's decoder layers (a ``ModuleList``).
    layers_name: str
    #: The base model's children its forward calls after the layers, in order (the final norm).
    tail_names: tuple[str, ...]

    @property
    def base(self) -> nn.Module:
        """The base model."""
        return self.model.get_submodule(self.base_name)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers."""
        layers = self.base.get_submodule(self.layers_name)
        assert isinstance(layers, nn.ModuleList)
        return layers

    def pre_names(self) -> tuple[str, ...]:
        """The base model's children that run before the decoder layers (the embeddings,
        rotary position embeddings, dropout): every child that is neither the layers nor
        after them."""
        after = {self.layers_name, *self.tail_names}
        return tuple(name for name in self.base._modules if name not in after)

    def head_names(self) -> tuple[str, ...]:
        """The causal LM's own children besides its base model (the head)."""
        return tuple(name for name in self.model._modules if name != self.base_name)


def find_layout(model: object) -> Layout:
    """The layout of the causal LM ``model``.

    Raises:
        TypeError: ``model`` is not a Hugging Face ``PreTrainedModel``.
        LayoutError: it is an encoder-decoder model, has no base model, or neither a
            pipeline plan (``base_model_pp_plan``) nor a known layout, or its decoder
            layers are not a ``ModuleList``; the message names what is missing.
    """
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            "model must be a Hugging Face causal language model (a transformers "
            f"PreTrainedModel such as LlamaForCausalLM) (model: {name})"
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise LayoutError(
            f"encoder-decoder models are not supported: gpipe.transformers pipelines causal "
            f"language models, one stack of decoder layers (model: {name})"
        )
    prefix = model.base_model_prefix
    base = model._modules.get(prefix) if prefix else None
    if base is None or base is model:
        raise LayoutError(
            f"the model holds no base model under its base_model_prefix: pass a causal LM "
            f"such as {name.removesuffix('Model')}ForCausalLM, whose base model is "
            f"model.{prefix or 'model'} (model: {name}, base_model_prefix: {prefix!r})"
        )
    model_type = getattr(config, "model_type", None)
    plan = getattr(config, "base_model_pp_plan", None)
    if plan:
        keys = list(plan)
        candidates = [key for key in keys if isinstance(base._modules.get(key), nn.ModuleList)]
        if len(candidates) != 1:
            raise LayoutError(
                f"the pipeline plan of {type(config).__name__} names no single ModuleList of "
                f"decoder layers in model.{prefix} (plan: {keys})"
            )
        layers_name = candidates[0]
        tail = tuple(keys[keys.index(layers_name) + 1 :])
    elif model_type in _KNOWN:
        layers_name, tail = _KNOWN[model_type]
    else:
        raise LayoutError(
            f"{type(config).__name__} has no pipeline plan (base_model_pp_plan), and its "
            f"model type {model_type!r} is not one whose layout gpipe knows: a causal LM "
            f"whose configuration has a plan (Llama, Mistral, Qwen2, Gemma and most decoders) "
            f"or GPT-2 can be pipelined (model: {name})"
        )
    layers = base._modules.get(layers_name)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise LayoutError(
            f"the decoder layers model.{prefix}.{layers_name} are missing or empty (model: "
            f"{name}, model.{prefix}.{layers_name}: {type(layers).__name__})"
        )
    if not tail:
        raise LayoutError(
            f"the pipeline plan of {type(config).__name__} names no module after the decoder "
            f"layers (a final norm), where the first partition's run of model.{prefix}'s "
            f"forward stops (plan: {list(plan or {})}, model: {name})"
        )
    missing = [key for key in tail if base._modules.get(key) is None]
    if missing:
        raise LayoutError(
            f"the modules after the decoder layers are missing from model.{prefix} "
            f"(missing: {missing}, model: {name})"
        )
    if getattr(config, "output_router_logits", False):
        raise LayoutError(
            "a mixture-of-experts auxiliary loss (output_router_logits=True) is not supported "
            f"in a pipeline: set config.output_router_logits = False (model: {name})"
        )
    return Layout(model, prefix, layers_name, tail)
