"""A causal LM as a sequence of its own modules: :func:`sequence`, built from its layout
(:mod:`._layout`) of the pieces of :mod:`._pieces`, and checked to give the model's logits
on the layout's probe before anything else runs.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ._layout import WRITE_IT, Layout, LayoutError, evaluating, find_layout, probe_inputs, probing
from ._names import EMBED, HEAD, layer_name
from ._pieces import Decoder, Embed, Head

__all__ = ["sequence"]


def sequence(model: nn.Module) -> nn.Sequential:
    """The causal LM ``model`` as an :class:`~torch.nn.Sequential` of its own modules: what
    runs before the decoder layers (the embeddings), each decoder layer, and what runs after
    them (the final norm and the head). Called with the model's inputs
    (``input_ids=..., attention_mask=...``), it returns the model's logits.

    This is the sequence :func:`pipeline` splits; pass it to
    :func:`~gpipe_balance.balance_by_time` to balance by measured times (the balance then
    counts its layers: one more on the first partition, one more on the last).

    Raises:
        TypeError, LayoutError: as :func:`pipeline`.
    """
    layout = find_layout(model)
    return _sequence(layout)


def _sequence(layout: Layout) -> nn.Sequential:
    count = len(layout.layers)
    pieces: OrderedDict[str, nn.Module] = OrderedDict()
    pieces[EMBED] = Embed(
        layout.model, layout.base_path, layout.layers_path, layout.tail_paths, layout.outputs
    )
    for index, layer in enumerate(layout.layers):
        pieces[layer_name(index)] = Decoder(
            layer,
            index,
            last=index == count - 1,
            config=layout.model.config,
            outputs=layout.outputs,
            handed=layout.handed,
        )
    pieces[HEAD] = Head(
        layout.model,
        layout.base_path,
        layout.tail_paths,
        layout.head_children(),
        layout.tail_casts,
    )
    sequence = nn.Sequential(pieces)
    _probed(layout, sequence)
    return sequence


def _probed(layout: Layout, sequence: nn.Sequential) -> None:
    """Refuse a sequence whose embeddings and head do not give the model's logits on the
    layout's probe (the layers handing their hidden states on): the family's code around
    its layers does what the pieces cannot (its head reads the inputs, its hidden states
    carry the batch elsewhere)."""
    probe = layout.probe
    if probe is None:
        return
    name = type(layout.model).__name__
    embed, head = sequence[0], sequence[-1]
    assert isinstance(head, Head)
    modes = embed.training, head.training
    try:
        with evaluating(layout.model), probing(layout.model):
            embed.training = head.training = False
            carry = embed(**probe_inputs(layout.model))
            try:
                logits = head(carry)
            except Exception:
                # A head that reads the inputs' shape (Gemma 4's): given ids of that shape.
                head.ids_shape = True
                logits = head(carry)
            shape = tuple(logits.shape)
            same = shape == probe.shape and (
                probe.logits is None or bool(torch.equal(logits, probe.logits))
            )
    except Exception as error:
        raise LayoutError(
            f"{name}'s code around its decoder layers does not run in pieces: on the probe "
            f"of three tokens its embeddings or its head (after {list(layout.tail_paths)}) fail "
            f"({type(error).__name__}: {error}), as a head that reads the inputs' values "
            f"fails, which only the first partition has; {WRITE_IT} (model: {name})"
        ) from error
    finally:
        embed.training, head.training = modes
    if not same:
        raise LayoutError(
            f"{name}'s code around its decoder layers does not run in pieces: on the probe "
            f"of three tokens its embeddings and head give logits of shape "
            f"{shape}{'' if shape != probe.shape else ' or values'} that are not the model's "
            f"({probe.shape}); "
            f"{WRITE_IT} (model: {name})"
        )
