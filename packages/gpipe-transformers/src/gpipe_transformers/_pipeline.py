"""A Hugging Face causal LM as a pipeline: :func:`pipeline` and :class:`CausalLMPipe`.

It pipelines the sequence of a model's own modules (:mod:`._sequence`), converts a
balance of decoder layers into the sequence's, and trains to the model's own loss (a
:class:`~gpipe_core.BatchMean` of the next-token loss).
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from gpipe_core import BatchMean, CheckpointMode, GPipe, Init, Losses, NoChunk

from ._balance import partition_count, sequence_balance
from ._generate import generate
from ._layout import Layout, LayoutError, find_layout
from ._names import EMBED, HEAD, ModelNames, layer_name
from ._pieces import (
    KEEP,
    Decoder,
    Embed,
    causal_lm_count,
    causal_lm_total,
    shifted_count,
    shifted_total,
)
from ._router import Router, Tally, asked_tally, chunk_count, find_router, routed_step
from ._sequence import _sequence, sequence
from ._shown import shown
from ._weights import save_weights

__all__ = ["CausalLMPipe", "pipeline", "sequence"]

# What a pipeline does not return or cannot do, refused before anything runs.
_PACKED = (
    "packed sequences (flash attention's variable-length keywords) cannot be split into "
    "micro-batches"
)
_REFUSED = {
    "output_attentions": "a pipeline returns the logits only",
    "output_hidden_states": "a pipeline returns the logits only",
    "output_router_logits": "a pipeline's forward returns the logits only; step() takes it, "
    "and trains to the labels loss plus the router loss",
    "past_key_values": "a pipeline's forward keeps no cache: generate with pipe.generate()",
    "cache": "a pipeline's forward keeps no cache: generate with pipe.generate()",
    "return_dict": "a pipeline returns the logits only",
    **dict.fromkeys(("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"), _PACKED),
    "seq_idx": _PACKED,
}
# The causal LM's keywords of its loss, which step() takes with labels.
_LOSS = ("shift_labels", "num_items_in_batch")
# GPipe.step's own keywords.
_STEP = ("schedule", "reduction", "target", "loss_fn")


class CausalLMPipe(GPipe):
    """A pipeline of a Hugging Face causal LM (see :func:`pipeline`): a
    :class:`~gpipe_core.GPipe` whose step takes ``labels`` and trains to the model's own
    loss."""

    _layout: Layout
    """Where the model's modules are (:func:`~._layout.find_layout`)."""
    _names: ModelNames
    """The model's own names of the sequence's keys (what :meth:`_renaming` gives)."""
    _honoured: frozenset[str]
    """The keywords the pipeline passes on to the base model's forward."""
    _group: dist.ProcessGroup | None
    """The ranks of the pipeline (its ``group``, or its mesh's ``"pp"``; None: one
    process), which :meth:`save_pretrained` writes across."""
    _data_groups: tuple[dist.ProcessGroup, ...]
    """The pipeline's data-parallel groups (its ``data_group``, or its mesh's
    ``"dp_replicate"`` and ``"dp_shard"``), of which the first ranks write in
    :meth:`save_pretrained`."""
    _tally: Tally | LayoutError | None
    """The router loss's tally of a mixture-of-experts model (see :mod:`._router`), or why
    its router loss cannot be computed; None for a model without routers."""

    def __init__(
        self, layout: Layout, module: nn.Sequential, balance: list[int], **options: Any
    ) -> None:
        # Before GPipe's constructor, which asks for the names and the fields the ranks
        # agree on (its hooks _renaming and _agreed_fields read them): plain attributes,
        # which a module takes before its constructor.
        self._layout = layout
        self._names = ModelNames(layout)
        # Checked on the whole model, before the partitions free what is not theirs.
        model = layout.model
        router = find_router(model, layout.layers_path, type(model).__name__)
        if isinstance(router, LayoutError) and getattr(model.config, "output_router_logits", False):
            raise router
        super().__init__(module, balance, **options)
        self._honoured = _honoured(layout)
        self._group = self._config.placement.group
        self._data_groups = self._config.replicas.counted
        _free_remote(module, [piece for partition in self._partition_list() for piece in partition])
        #: The model's loss: the next-token cross entropy, averaged over the non-ignored
        #: labels of the whole mini-batch.
        self.loss = BatchMean(causal_lm_total, causal_lm_count)
        self._tally = router if not isinstance(router, Router) else self._counting(router)

    def _counting(self, router: Router) -> Tally:
        """The router loss's tally, given to the pieces that count in it."""
        tally = Tally(
            router, self._layout.layers_path, self._group, self._data_groups, self._config.timeout
        )
        for partition in self._partition_list():
            for piece in partition:
                if isinstance(piece, (Embed, Decoder)):
                    piece.tally = tally
        return tally

    @property
    def causal_lm(self) -> nn.Module:
        """The causal LM this pipeline trains; its modules are the pipeline's, so in one
        process its own ``save_pretrained`` writes the trained weights."""
        return self._layout.model

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write the trained model to the directory ``path`` in its own format, which
        ``AutoModelForCausalLM.from_pretrained(path)`` and :func:`from_pretrained` load:
        called on every rank of the pipeline's ``group`` (a collective), each writes its
        own tensors; see :func:`gpipe_transformers.save_pretrained`."""
        save_weights(self, self.causal_lm, path, self._group, self._data_groups)

    def _renaming(self) -> ModelNames:
        return self._names

    def _agreed_fields(self) -> tuple[tuple[str, object], ...]:
        # Said by the configuration's name, before the ties it makes (which the ranks
        # agree on too, by the model's names).
        config = self._layout.model.config
        tie = getattr(config, "tie_word_embeddings", None)
        return (("the model's config.tie_word_embeddings", tie),)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # The model's own children (``pipe.model``, ``pipe.lm_head``), so that its
            # names resolve on the pipeline: ``pipe.get_parameter("lm_head.weight")``.
            # Read from __dict__: this runs for any name not found, before _layout is
            # set too (a copy being made), where self._layout would call it again.
            layout = self.__dict__.get("_layout")
            if layout is not None and not name.startswith("_") and name in layout.model._modules:
                return layout.model._modules[name]
            raise

    def forward(self, *inputs: Any, **keywords: Any) -> Any:
        """The logits of the model's inputs (``input_ids=..., attention_mask=...``,
        ``logits_to_keep=...``), as ``model(...).logits``.

        Raises:
            ValueError, TypeError: a keyword the pipeline does not honour (the message
                names it), before anything runs.
        """
        _no_batch_dict(inputs, "pipe")
        return super().forward(*inputs, **self._checked(keywords, "forward"))

    def step(self, *inputs: Any, labels: Tensor | None = None, **keywords: Any) -> Losses:
        """A training step. With ``labels``, the loss is the model's own (``model(...,
        labels=labels).loss``: the next-token loss over every label that is not -100, of
        the whole mini-batch) and ``.reduced()`` equals it; without, the step is
        :meth:`GPipe.step <gpipe_core.GPipe.step>`'s (``target=`` and ``loss_fn=``
        given).

        The model's loss keywords are the model's too: ``shift_labels`` (the targets of
        each position, used instead of shifting ``labels``; it may come without them) and
        ``num_items_in_batch`` (an int or a 0-dimensional tensor, as transformers'
        ``Trainer`` passes for gradient accumulation: the loss is summed over the targets
        and divided by it, not by their count); with ``logits_to_keep`` the loss is over
        the logits kept, as the model's.

        Raises:
            ValueError, TypeError: a keyword the pipeline does not honour (the message
                names it), or ``num_items_in_batch`` that is not a positive count, before
                anything runs.
        """
        _no_batch_dict(inputs, "pipe.step")
        tally = asked_tally(self._tally, keywords, self._layout.model)
        shift_labels = keywords.pop("shift_labels", None)
        items = keywords.pop("num_items_in_batch", None)
        keywords = self._checked(keywords, "step")
        if labels is None and shift_labels is None:
            if tally is not None:
                raise TypeError(
                    "the router loss (output_router_logits=True) is added to the model's "
                    "labels loss: pass labels=, or output_router_logits=False to train to "
                    "target= and loss_fn= alone (labels: None)"
                )
            if items is not None:
                raise TypeError(
                    "num_items_in_batch divides the model's loss: pass labels or shift_labels "
                    f"with it (num_items_in_batch: {shown(items)}, labels: None)"
                )
            if "target" not in keywords and "loss_fn" not in keywords:
                raise TypeError(
                    "step needs labels: pipe.step(input_ids=..., attention_mask=..., "
                    "labels=...) trains to the model's own loss (or give target= and "
                    "loss_fn= for another loss) (labels: None)"
                )
            loss_fn = keywords.get("loss_fn")
            if callable(loss_fn) and not isinstance(loss_fn, BatchMean):
                keywords["loss_fn"] = _ShapedLoss(loss_fn)
            return super().step(*inputs, **keywords)
        for own in ("target", "loss_fn"):
            if own in keywords:
                raise TypeError(
                    f"step takes labels or {own}, not both: labels trains to the model's own "
                    f"loss ({own}: {type(keywords[own]).__name__})"
                )
        target: Any = labels if shift_labels is None else shift_labels
        loss = self.loss if shift_labels is None else _SHIFTED
        if items is not None:
            count = _items(items)
            size = target.shape[0] if isinstance(target, Tensor) and target.dim() else 1
            # Each sample's share of the count: the step's count is num_items_in_batch.
            share = torch.full((size,), count / size, dtype=torch.float64, device=target.device)
            target = (target, share)
            loss = _OVER_SHIFTED if shift_labels is not None else _OVER_ITEMS
        if tally is None:
            return super().step(*inputs, target=target, loss_fn=loss, **keywords)
        local = sum(isinstance(p, Decoder) for part in self._partition_list() for p in part)
        ids = keywords.get(
            "input_ids", keywords.get("inputs_embeds", inputs[0] if inputs else None)
        )
        losses = routed_step(
            tally,
            lambda: super(CausalLMPipe, self).step(
                *inputs, target=target, loss_fn=loss, **keywords
            ),
            local,
            chunk_count(ids, self.chunks),
        )
        assert losses is not None or not self._placement.is_local(-1)
        return losses  # type: ignore[return-value]

    def generate(self, inputs: Tensor | None = None, **options: Any) -> Tensor:
        """Generate through the pipeline what ``model.generate(inputs, **options)`` gives:
        the prompts and their new tokens, sequences that stopped padded with
        ``pad_token_id``.

        The options are transformers' own (``input_ids``, ``attention_mask``,
        ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``, ``stopping_criteria``,
        ``logits_processor``, ``generation_config``; the model's ``generation_config`` is
        the default), applied by transformers' own logits processors and stopping
        criteria. The batch is split into ``chunks`` lanes, each with its own cache on
        every partition (its layers' only): the prompts are prefilled, then partition ``j``
        computes a lane's next token while partition ``j - 1`` computes the next lane's
        (see :meth:`GPipe.decode <gpipe_core.GPipe.decode>`); a lane whose sequences
        have all stopped stops.

        Greedy generation gives the model's tokens for any ``chunks`` and balance;
        sampling with ``chunks=1`` draws the model's tokens under the same seed, and with
        several lanes each token from the model's distribution (the lanes draw in turn).
        With ``group`` every rank calls it with the same prompts and options (the ranks
        are refused at once if the options differ), and every rank gets the sequences.

        Raises:
            ValueError: an option a pipeline does not support (beam search, assisted
                decoding, returning scores or hidden states, ``use_cache=False``, a
                family whose cache holds layers other than attention's), named, before
                anything runs.

        Example:
            >>> import torch
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> config = LlamaConfig(
            ...     vocab_size=64,
            ...     hidden_size=16,
            ...     intermediate_size=32,
            ...     num_hidden_layers=2,
            ...     num_attention_heads=2,
            ...     pad_token_id=0,
            ... )
            >>> model = LlamaForCausalLM(config).eval()
            >>> pipe = pipeline(model, balance=[1, 1], chunks=2)
            >>> ids = torch.randint(1, 64, (4, 5))
            >>> tokens = pipe.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
            >>> torch.equal(
            ...     tokens, model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
            ... )
            True
        """
        return generate(self, inputs, options)

    def _checked(self, keywords: dict[str, Any], method: str) -> dict[str, Any]:
        """``keywords`` as the pipeline passes them on, or the refusal of one it does
        not honour: a tensor ``logits_to_keep`` of positions is every micro-batch's."""
        honoured = self._honoured
        passed: dict[str, Any] = {}
        for name, value in keywords.items():
            if name in honoured or (method == "step" and name in _STEP):
                passed[name] = value
            elif name == KEEP:
                whole = isinstance(value, Tensor) and value.dim() <= 1
                passed[name] = NoChunk(value) if whole else value
            elif value is None or (value is False and name in (*_REFUSED, "use_cache")):
                continue  # what the model does without it
            elif name in _REFUSED:
                why = _REFUSED[name]
                raise ValueError(f"{name} is not supported: {why} ({name}: {shown(value)})")
            elif name == "use_cache":
                raise ValueError(
                    "use_cache is not supported: a pipeline's forward keeps no cache; "
                    "generate with pipe.generate(), which keeps each partition's cache "
                    f"(use_cache: {shown(value)})"
                )
            elif name == "labels" or name in _LOSS:
                raise TypeError(
                    f"forward returns the logits: pass {name} to step(), which returns the "
                    f"model's own loss ({name} given to forward)"
                )
            else:
                layout = self._layout
                raise TypeError(
                    f"{name} is not a keyword a pipeline of {type(layout.model).__name__} "
                    f"honours: it takes those of {type(layout.base).__name__}.forward "
                    f"({', '.join(sorted(honoured))}) and {KEEP}, and step() also labels, "
                    f"shift_labels and num_items_in_batch ({name}: {shown(value)})"
                )
        return passed


def _no_batch_dict(inputs: tuple[Any, ...], call: str) -> None:
    """Refuse a batch dict given positionally, which the embeddings would take as ids."""
    if len(inputs) == 1 and isinstance(inputs[0], Mapping):
        keys = ", ".join(map(str, inputs[0]))
        raise TypeError(
            f"{call}() takes the model's inputs by keyword: pass a batch dict as "
            f"{call}(**batch) (a dict given positionally, keys: {keys})"
        )


class _ShapedLoss:
    """A ``loss_fn`` of step() whose failure on the logits says how to shape them."""

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn

    def __call__(self, logits: Tensor, target: Any) -> Any:
        try:
            return self.loss_fn(logits, target)
        except (RuntimeError, ValueError) as error:
            shape = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
            raise type(error)(
                f"loss_fn failed on the logits of shape {tuple(logits.shape)} and a target "
                f"of shape {shape} ({error}): a loss over the vocabulary such as "
                "cross_entropy takes the logits flattened to (tokens, vocabulary) and the "
                "targets to (tokens,): loss_fn=lambda logits, target: cross_entropy("
                "logits.flatten(0, -2), target.flatten()); or pass labels= for the model's "
                "own loss"
            ) from error


def _free_remote(module: nn.Sequential, local: list[nn.Module]) -> None:
    """Free the tensors of ``module``'s pieces that other ranks run (not in ``local``),
    unless a local piece uses them too (a tied head): they move to the meta device, in the
    model itself, so that a rank holds only its own layers."""
    held = {id(t) for piece in local for t in (*piece.parameters(), *piece.buffers())}
    mine = {id(piece) for piece in local}
    for piece in module:
        if id(piece) in mine:
            continue
        for inner in piece.modules():
            for name, parameter in list(inner._parameters.items()):
                if parameter is not None and id(parameter) not in held:
                    inner._parameters[name] = nn.Parameter(
                        parameter.to("meta"), requires_grad=parameter.requires_grad
                    )
            for name, buffer in list(inner._buffers.items()):
                if buffer is not None and id(buffer) not in held:
                    inner._buffers[name] = buffer.to("meta")


def _honoured(layout: Layout) -> frozenset[str]:
    """The keywords a pipeline of ``layout``'s model passes on to its base model's
    forward: those its signature names, but for what the pipeline refuses."""
    parameters = inspect.signature(type(layout.base).forward).parameters.values()
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(named - {"self", "use_cache", "labels", KEEP, *_LOSS, *_REFUSED})


def _items(items: object) -> float:
    """``num_items_in_batch`` as a number, or its refusal."""
    number = isinstance(items, int) and not isinstance(items, bool)
    if number or (isinstance(items, Tensor) and items.dim() == 0 and not items.is_complex()):
        count = float(items)  # type: ignore[arg-type]
    else:
        raise TypeError(
            "num_items_in_batch must be an int or a 0-dimensional tensor: the count of targets "
            f"the model's summed loss is divided by (num_items_in_batch: {shown(items)})"
        )
    if not count > 0:
        raise ValueError(
            "num_items_in_batch must be positive: the model's summed loss is divided by it "
            f"(num_items_in_batch: {shown(items)})"
        )
    return count


def _target_total(logits: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    return causal_lm_total(logits, target[0])


def _shifted_target_total(logits: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    return shifted_total(logits, target[0])


def _share(target: tuple[Tensor, Tensor]) -> Tensor:
    return target[1].sum()


# The model's loss with shift_labels, and either with num_items_in_batch: the target is
# then (labels, each sample's share of num_items_in_batch).
_SHIFTED = BatchMean(shifted_total, shifted_count)
_OVER_ITEMS = BatchMean(_target_total, _share)
_OVER_SHIFTED = BatchMean(_shifted_target_total, _share)


def pipeline(
    model: nn.Module,
    *,
    balance: Sequence[int] | None = None,
    chunks: int = 1,
    checkpoint: CheckpointMode = "except_last",
    devices: Sequence[Any] | None = None,
    group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    placement: str | Sequence[int] | None = None,
    timeout: float | datetime.timedelta | object | None = ...,
    init: Init = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
) -> CausalLMPipe:
    """A pipeline of the Hugging Face causal LM ``model``'s own modules.

    Works for every causal LM whose configuration has a pipeline plan
    (``base_model_pp_plan``: Llama, Mistral, Qwen2, Gemma and most decoders) and for GPT-2.
    What the family does before its first decoder layer (embedding scaling, masks, rotary
    position embeddings, dropout) runs on the first partition and after its last (the final
    norm, the head, logit scaling, soft-capping) on the last, as the family's own code.

    Args:
        model: the causal LM (``AutoModelForCausalLM.from_config(...)``).
        balance: decoder layers per partition (the embeddings go with the first, the norm
            and the head with the last); default: the layers split evenly over the
            partitions (one per device, or per rank of ``group``). A balance of the whole
            :func:`sequence` (two more layers, as
            :func:`~gpipe_balance.balance_by_time` gives) is taken as it is.
        chunks, checkpoint, devices, group, data_group, placement, timeout, init: as
            :class:`~gpipe_core.GPipe`'s (``init`` initialises the layers of a model built
            on the meta device; :func:`from_pretrained` gives it; its state dicts have the
            model's own keys, as ``model.state_dict()`` gives them).
        mesh: a :class:`~torch.distributed.device_mesh.DeviceMesh` to run on instead of
            ``group`` (see :doc:`/mesh`): each data-parallel rank steps on its own share of
            the mini-batch.
        reshard_after_forward: as :class:`~gpipe_core.GPipe`'s, with ``mesh``.

    Returns:
        The pipeline: ``pipe(input_ids=..., attention_mask=...)`` gives the logits,
        ``pipe.step(input_ids=..., attention_mask=..., labels=...)`` the model's own loss
        and its gradients.

    Raises:
        TypeError: ``model`` is not a Hugging Face model.
        LayoutError: the model's layout cannot be found (the message names what is
            missing), or it is not supported (encoder-decoder models, a mixture-of-experts
            auxiliary loss).
        ValueError: ``balance`` does not sum to the decoder layers; a state dict of
            ``init`` holds a key of no tensor of the model.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(
        ...     vocab_size=64,
        ...     hidden_size=16,
        ...     intermediate_size=32,
        ...     num_hidden_layers=2,
        ...     num_attention_heads=2,
        ... )
        >>> model = LlamaForCausalLM(config)
        >>> pipe = pipeline(model, balance=[1, 1], chunks=2)
        >>> ids = torch.randint(64, (4, 8))
        >>> losses = pipe.step(input_ids=ids, labels=ids)
        >>> torch.allclose(losses.reduced(), model(input_ids=ids, labels=ids).loss)
        True
    """
    layout = find_layout(model)
    name = type(model).__name__
    if init is None:
        _no_meta(model, name)
    parts = partition_count(devices, group, placement, mesh)
    counts = sequence_balance(balance, len(layout.layers), parts, name)
    options: dict[str, Any] = {
        "devices": devices, "chunks": chunks, "checkpoint": checkpoint, "group": group,
        "data_group": data_group, "placement": placement,
    }  # fmt: skip
    if timeout is not ...:
        options["timeout"] = timeout
    if mesh is not None or reshard_after_forward is not None:
        options["mesh"], options["reshard_after_forward"] = mesh, reshard_after_forward
    if init is not None:
        options["init"] = _init_keys(init, layout)
    return CausalLMPipe(layout, _sequence(layout), counts, **options)


def _no_meta(model: nn.Module, name: str) -> None:
    """Refuse a model whose tensors are on the meta device without ``init``: it holds no
    weights to train."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [key for key, tensor in tensors if tensor.is_meta]
    if meta:
        raise ValueError(
            f"the model's tensors are on the meta device, without values to train ({len(meta)} "
            f"of {len(tensors)}: {', '.join(meta[:4])}{' ...' if len(meta) > 4 else ''}): "
            "load a saved model with gpipe.transformers.from_pretrained(path, ...), which "
            "reads each rank's own layers, or give pipeline(..., init=...) what sets them "
            f"(model: {name})"
        )


def _init_keys(init: Init, layout: Layout) -> Init:
    """``init`` whose state dicts have the model's own keys
    (``model.layers.0.self_attn.q_proj.weight``) with the sequence's keys instead (those
    of :func:`sequence`'s state dict are kept), or the refusal of a key of neither."""
    names = ModelNames(layout)
    pieces = {EMBED, HEAD, *(layer_name(k) for k in range(len(layout.layers)))}
    several = isinstance(init, (list, tuple))
    steps = list(init) if isinstance(init, (list, tuple)) else [init]
    found: list[Any] = []
    for index, step in enumerate(steps):
        if not isinstance(step, Mapping):
            found.append(step)  # a callable (or what gpipe-core refuses)
            continue
        keys: dict[object, object] = {}
        unknown: list[str] = []
        for name, value in step.items():
            key = names.key(name) if isinstance(name, str) else None
            if key is None or key.partition(".")[0] not in pieces:
                own = isinstance(name, str) and name.partition(".")[0] in pieces
                key = name if own or not isinstance(name, str) else None
            if key is None:
                unknown.append(name)
            else:
                keys[key] = value
        if unknown:
            where = f"init[{index}]" if several else "init"
            example = next(iter(layout.model.state_dict()), "")
            raise ValueError(
                f"{where} holds keys of no tensor of the model {type(layout.model).__name__}: "
                f"a state dict for init has the model's own keys, as model.state_dict() "
                f"gives them, such as {example!r} ({where} keys: {unknown[:8]}"
                f"{' ...' if len(unknown) > 8 else ''})"
            )
        found.append(keys)
    return found if several else found[0]
