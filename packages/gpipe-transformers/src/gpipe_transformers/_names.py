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
    """The model's names of the sequence's keys, and back, for the model of ``layout``."""

    def __init__(self, layout: Layout) -> None:
        self.base = layout.base_name
        self.layers = f"{layout.base_name}.{layout.layers_name}"
        self.tail = set(layout.tail_names)
        self.head = set(layout.head_names())

    def rename(self, key: str) -> str | None:
        piece, _, rest = key.partition(".")
        if not rest:
            return None  # a piece itself: the model has no such module
        if piece == EMBED:
            return f"{self.base}.{rest}"
        if piece == HEAD:
            return f"{self.base}.{rest}" if rest.partition(".")[0] in self.tail else rest
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
        if name.startswith(f"{self.base}."):
            rest = name[len(self.base) + 1 :]
            return f"{HEAD if rest.partition('.')[0] in self.tail else EMBED}.{rest}"
        if name.partition(".")[0] in self.head:
            return f"{HEAD}.{name}"
        return None
