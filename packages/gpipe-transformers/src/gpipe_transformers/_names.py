"""The model's own names for the pipeline's: the pieces of :mod:`._pieces` sit in the
pipeline's sequence as ``embed``, ``layer0`` ... and ``head``; the model calls the same
tensors ``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``,
``model.norm.weight`` and ``lm_head.weight``. :class:`ModelNames` maps one onto the other
(gpipe-core's :class:`~gpipe_core._state_dict.Renaming`), so that ``named_parameters()``,
``state_dict()`` and the loads use the model's names.
"""

from __future__ import annotations

from ._layout import Layout

__all__ = ["EMBED", "HEAD", "ModelNames", "layer_name"]

EMBED = "embed"
HEAD = "head"
_LAYER = "layer"


def layer_name(index: int) -> str:
    """The sequence's name of decoder layer ``index``'s piece."""
    return f"{_LAYER}{index}"


class ModelNames:
    """The model's names of the sequence's keys, and back, for the model of ``layout``:
    the embeddings' and the head's keys are the model's after their piece's name
    (``embed.model.embed_tokens.weight``, ``head.lm_head.weight``), a layer's are the
    layers' path, its index and its own (``layer0.layer.self_attn...``)."""

    def __init__(self, layout: Layout) -> None:
        self.layers = layout.layers_path
        self.tail = layout.tail_paths
        self.head = set(layout.head_children())
        self.children = set(layout.model._modules)

    def rename(self, key: str) -> str | None:
        piece, _, rest = key.partition(".")
        if not rest:
            return None  # a piece itself: the model has no such module
        if piece in (EMBED, HEAD):
            return rest
        index = piece.removeprefix(_LAYER)
        inner, _, more = rest.partition(".")
        if piece.startswith(_LAYER) and index.isdigit() and inner == _LAYER:
            return ".".join(filter(None, (self.layers, index, more)))
        return key

    def key(self, name: str) -> str | None:
        if name.startswith(f"{self.layers}."):
            index, _, more = name[len(self.layers) + 1 :].partition(".")
            if index.isdigit():
                return ".".join(filter(None, (layer_name(int(index)), _LAYER, more)))
            return None
        top = name.partition(".")[0]
        if top not in self.children or top == name:
            return None
        after = top in self.head or any(name.startswith(f"{path}.") for path in self.tail)
        return f"{HEAD if after else EMBED}.{name}"
