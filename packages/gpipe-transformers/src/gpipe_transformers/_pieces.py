"""A causal LM as a sequence of layers: what runs before the decoder layers
(:class:`Embed`), each decoder layer (:class:`Decoder`), and what runs after them
(:class:`Head`), each running the family's own code.

The family's code around its layers is its base model's ``forward`` and its causal LM's
``forward``. They are called, unchanged, on *stand-ins*: shallow copies of the model and
of the modules on the way to its layers (:mod:`._stand_in`), whose children are the
model's own but for a few, replaced for the call:

- :class:`Embed` calls the base model's forward with each decoder layer replaced by a
  :class:`~._layout.Passer`, which notes the arguments the forward gives that layer (the
  attention mask the family built for it, its rotary position embeddings, its position ids)
  and passes the hidden states on; the last layer's stops the call (or, where the forward
  passes over the last layers, the first module after them). Its output is the first
  layer's hidden states and every layer's arguments (a :class:`Carry`), None for a layer
  the forward passed over, which :class:`Decoder` then passes over too.
- :class:`Decoder` calls its decoder layer with the hidden states and the arguments noted
  for it.
- :class:`Head` calls the modules the base model's forward calls on the hidden states
  after the layers (the final norm: the layout's tail), then the causal
  LM's forward with its base model replaced by one that returns the hidden states: the
  head, logit scaling and soft-capping run as the family wrote them.

The model itself is never changed, so that it stays usable on its own, and the stand-ins
follow its mode. It must not know pipelines or losses.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_core import lane_state

from ._layout import Handed, Passer, no_router_logits
from ._router import CHUNKS, MASK, Tally
from ._stand_in import only, stand_ins, without

__all__ = ["KEEP", "Carry", "Decoder", "Embed", "Head", "new_cache"]

# The carry's keys: the hidden states, the layers' arguments (a value that is not a
# tensor: their structure) and their tensors, each once, as t0, t1, ...; and the causal
# LM's logits_to_keep, from the embeddings to the head (where given).
HIDDEN = "hidden_states"
ARGUMENTS = "layer_arguments"
KEEP = "logits_to_keep"


@dataclass(frozen=True)
class _Ref:
    """Where a layer's argument is a tensor: the carry's ``t<index>``."""

    index: int


def _flatten(value: object, tensors: dict[int, int], table: list[Tensor]) -> object:
    """``value`` with each tensor replaced by a :class:`_Ref` into ``table`` (each tensor
    once, by identity)."""
    if isinstance(value, Tensor):
        index = tensors.get(id(value))
        if index is None:
            index = tensors[id(value)] = len(table)
            table.append(value)
        return _Ref(index)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_flatten(item, tensors, table) for item in value)
    if type(value) is dict:
        return {key: _flatten(item, tensors, table) for key, item in value.items()}
    return value


def _unflatten(value: object, table: Mapping[str, object]) -> Any:
    if isinstance(value, _Ref):
        return table[f"t{value.index}"]
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_unflatten(item, table) for item in value)
    if type(value) is dict:
        return {key: _unflatten(item, table) for key, item in value.items()}
    return value


#: A decoder layer's arguments after its hidden states: positional and keyword.
_Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class _Structure:
    """The structure of every decoder layer's other arguments, their tensors replaced by
    :class:`_Ref`: one value that is not a container, so that the checks of a partition's
    output do not walk it (it holds no tensor)."""

    calls: tuple[object, ...]


class Carry:
    """What passes from layer to layer: a dict of the hidden states, the structure of
    every decoder layer's other arguments, and their tensors (``t0``, ``t1``, ...)."""

    @staticmethod
    def make(hidden: Tensor, calls: list[_Call | None]) -> dict[str, object]:
        """The carry of ``hidden`` and each layer's other arguments ``calls`` (None for a
        layer passed over)."""
        tensors: dict[int, int] = {}
        table: list[Tensor] = []
        structure = _Structure(tuple(_flatten(call, tensors, table) for call in calls))
        carry: dict[str, object] = {HIDDEN: hidden, ARGUMENTS: structure}
        carry.update((f"t{k}", tensor) for k, tensor in enumerate(table))
        return carry

    @staticmethod
    def arguments(carry: Mapping[str, object], index: int) -> _Call | None:
        """The other arguments of decoder layer ``index`` (None: the family's forward
        passed over it)."""
        structure = carry[ARGUMENTS]
        assert isinstance(structure, _Structure)
        call = structure.calls[index]
        if call is None:
            return None
        args, kwargs = _unflatten(call, carry)
        return args, kwargs


@dataclass(frozen=True)
class _CacheSlot:
    """Where a decoder layer's argument is the cache: each partition puts its lane's there."""


def new_cache(config: Any) -> Any:
    """A lane's cache for the model of ``config``: transformers' own ``DynamicCache``, one
    layer of it per decoder layer (sliding-window layers where the family has them); a
    partition fills its own layers' only.

    Raises:
        ValueError: the family's cache has layers that are not attention's (linear
            attention, state-space layers), which a pipeline does not generate with yet.
    """
    # Local, as the package's other imports of transformers: only generation needs them.
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    kinds = {type(layer).__name__ for layer in cache.layers}
    if not all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        raise ValueError(
            "generate supports the caches of attention layers (full and sliding-window): "
            f"{type(config).__name__}'s cache has layers of the kinds {sorted(kinds)}; "
            "generate with the model itself on one device"
        )
    return cache


def cache_argument(base: nn.Module) -> str:
    """The name of the cache in ``base``'s forward: ``cache`` (transformers 5.24 on) or
    ``past_key_values``."""
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _with_slots(call: Any, cache: object) -> tuple[Any, bool]:
    """``call`` (a layer's arguments) with ``cache`` replaced by a :class:`_CacheSlot`, and
    whether it was there."""
    args, kwargs = call
    found = any(value is cache for value in (*args, *kwargs.values()))
    slot = _CacheSlot()
    args = tuple(slot if value is cache else value for value in args)
    kwargs = {name: slot if value is cache else value for name, value in kwargs.items()}
    return (args, kwargs), found


def _filled(args: tuple[Any, ...], kwargs: dict[str, Any], cache: object) -> Any:
    """A layer's arguments with its lane's ``cache`` in its :class:`_CacheSlot`."""
    args = tuple(cache if isinstance(value, _CacheSlot) else value for value in args)
    kwargs = {
        name: cache if isinstance(value, _CacheSlot) else value for name, value in kwargs.items()
    }
    return args, kwargs


class _Stop(Exception):
    """Ends the base model's forward after its last decoder layer."""


def _relative(paths: tuple[str, ...], name: str) -> list[str]:
    """The paths under the causal LM's child ``name``, relative to it."""
    return [path.partition(".")[2] for path in paths if path.partition(".")[0] == name]


class Embed(nn.Module):
    """What the base model's forward does before its first decoder layer, as its own code.

    It holds the causal LM's child that holds the base model, without the decoder layers
    and the modules after them (under the model's own names), and returns a
    :class:`Carry`, which also takes the causal LM's ``logits_to_keep`` to the head.
    """

    _model: nn.Module
    _layers: list[nn.Module]
    _base_path: str
    _layers_path: str
    _tail_paths: tuple[str, ...]
    _outputs: int
    _cache_name: str

    def __init__(
        self,
        model: nn.Module,
        base_path: str,
        layers_path: str,
        tail_paths: tuple[str, ...],
        outputs: int = 0,
    ) -> None:
        super().__init__()
        top = base_path.partition(".")[0]
        holder = model._modules[top]
        assert holder is not None
        self.add_module(top, without(holder, _relative((layers_path, *tail_paths), top)))
        # The model and its layers are not this module's children: the pipeline holds
        # each layer once, in its Decoder. Set through __dict__, so that nn.Module's
        # __setattr__ does not register the model as a child.
        layers = model.get_submodule(layers_path)
        assert isinstance(layers, nn.ModuleList)
        self.__dict__["_model"] = model
        self._layers = list(layers)
        self._base_path = base_path
        self._layers_path = layers_path
        self._tail_paths = tail_paths
        self._outputs = outputs
        self._cache_name = cache_argument(model.get_submodule(base_path))
        #: In a step that trains to the router loss as well, its tally (see _router).
        self.tally: Tally | None = None

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, object]:
        keep = kwargs.pop(KEEP, None)  # the causal LM's, for the head
        count = len(self._layers)
        # The arguments of each layer the forward calls (None: one it passes over).
        calls: list[_Call | None] = [None] * count
        first: list[Tensor] = []
        called: list[int] = []

        def note(
            index: int, hidden: Tensor, args: tuple[object, ...], kwargs: dict[str, object]
        ) -> None:
            # The arguments of each layer, the first layer's hidden states; the last layer,
            # or the first module after the layers, ends the forward.
            if called and index <= called[-1]:
                raise RuntimeError(
                    f"{type(self._model).__name__}'s forward called its decoder layer "
                    f"{index} after layer {called[-1]}: a pipeline runs each layer at most "
                    "once, in order"
                )
            if not first:
                first.append(hidden)
            called.append(index)
            calls[index] = (args, kwargs)
            if index == count - 1:
                raise _Stop

        passers = [Passer(layer, k, self._outputs, note) for k, layer in enumerate(self._layers)]
        # After a last layer the forward passes over, the tail's first module ends it.
        replaced: dict[str, object] = {self._layers_path: passers}
        for path in self._tail_paths:
            replaced[path] = _Stopper(self._model.get_submodule(path), called)
        base = stand_ins(self._model, self.training, replaced)[self._base_path]
        # In a lane of a decode run (generation), the base model builds its masks from a
        # cache that knows how many positions each layer holds (see _advance); the
        # layers get their own partition's cache instead.
        lane = lane_state(self)
        masks = None
        if lane is None:
            kwargs.setdefault("use_cache", False)
        else:
            masks = lane.get("masks")
            if masks is None:
                masks = lane["masks"] = new_cache(base.config)
            kwargs[self._cache_name], kwargs["use_cache"] = masks, True
        try:
            base.forward(*args, **kwargs, **no_router_logits(base))
        except _Stop:
            pass
        else:
            if self._tail_paths:
                raise RuntimeError(
                    f"{type(base).__name__}.forward returned without calling its last "
                    f"decoder layer or {self._tail_paths[0]}: a pipeline runs each layer "
                    "at most once, in order, then what follows them"
                )
        if not first:
            raise RuntimeError(
                f"{type(base).__name__}.forward called none of its {count} decoder layers"
            )
        if masks is not None:
            for index in called:
                calls[index], found = _with_slots(calls[index], masks)
                if not found:
                    raise ValueError(
                        f"{type(base).__name__}.forward gives its decoder layer {index} no "
                        "cache, which generation needs: generate with the model itself on "
                        "one device"
                    )
            _advance(masks, first[0], called)
        carry = Carry.make(first[0], calls)
        if keep is not None:
            carry[KEEP] = keep
        tally = self.tally
        if tally is not None and tally.active:
            # The tokens the router loss counts, and how many micro-batches there are.
            mask = kwargs.get("attention_mask")
            hidden = first[0]
            carry[MASK] = (
                hidden.new_ones(hidden.shape[:2], dtype=torch.long) if mask is None else mask
            )
            carry[CHUNKS] = torch.tensor(tally.chunks)
        return carry


def _advance(masks: Any, hidden: Tensor, called: list[int]) -> None:
    """Let the masks' cache hold as many positions as the layers' caches after this
    call: each layer of it the forward ``called`` takes the call's positions with keys and
    values of one sample, one head and one channel (transformers' cache counts no position
    in an empty tensor), so that it answers the mask sizes (sliding windows included) as
    the layers' own caches would, at a cost of one number per position; a layer passed over
    holds none, as its own cache."""
    tiny = hidden.new_zeros((1, 1, hidden.shape[1], 1))
    for index in called:
        masks.update(tiny, tiny, index)


class _Stopper:
    """Stands for the first module after the layers in :class:`Embed`'s call: ends the
    forward once a layer has been called (the last one being passed over), else is the
    module."""

    __slots__ = ("called", "module")

    def __init__(self, module: nn.Module, called: list[int]) -> None:
        self.module, self.called = module, called

    def __call__(self, *args: object, **kwargs: object) -> Any:
        if self.called:
            raise _Stop
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class Decoder(nn.Module):
    """Decoder layer ``index``, called with the arguments the base model's forward gives it.

    Where the family's layers return a tuple (``outputs`` items, the hidden states first),
    so does this one, and the items ``handed`` to the next layer pass in the carry (as
    ``handed<position>``) to the arguments noted as :class:`~._layout.Handed`. The last
    decoder layer returns its hidden states alone (with the causal LM's
    ``logits_to_keep``, where given); the others a :class:`Carry`.
    In a lane of a decode run, the layer's cache is its lane's: one per lane for the
    layers of ``config``'s model that this process holds.
    """

    _config: Any

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        last: bool,
        config: Any = None,
        outputs: int = 0,
        handed: tuple[tuple[int, int | str], ...] = (),
    ) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self.last = last
        self.outputs = outputs
        self.handed = handed
        self.__dict__["_config"] = config
        #: In a step that trains to the router loss as well, its tally (see _router).
        self.tally: Tally | None = None

    def forward(self, carry: dict[str, object]) -> object:
        call = Carry.arguments(carry, self.index)
        if call is None:  # a layer the family's forward passed over in this call
            return _last_output(carry) if self.last else carry
        args, kwargs = call
        lane = lane_state(self._config) if self._config is not None else None
        if lane is not None:
            cache = lane.get("cache")
            if cache is None:
                cache = lane["cache"] = new_cache(self._config)
            args, kwargs = _filled(args, kwargs, cache)
        if self.index and self.handed:
            args = tuple(_from(carry, value) for value in args)
            kwargs = {name: _from(carry, value) for name, value in kwargs.items()}
        hidden = carry[HIDDEN]
        tally = self.tally if self.tally is not None and self.tally.active else None
        if tally is None:
            output = self.layer(hidden, *args, **kwargs)
        else:
            with tally.collecting(self.layer, self.index) as logits:
                output = self.layer(hidden, *args, **kwargs)
        items: Any = output
        # Older families' layers return (hidden, ...) or [hidden, ...].
        if self.outputs or isinstance(output, tuple):
            output = output[0]
        if tally is not None:
            output = tally.add(output, logits, carry[MASK], carry[CHUNKS])
        if self.last:
            return _last_output({**carry, HIDDEN: output})
        handed = {f"{_HANDED}{position}": items[position] for position, _ in self.handed}
        return {**carry, HIDDEN: output, **handed}

    def extra_repr(self) -> str:
        return f"index={self.index}"


_HANDED = "handed"


def _last_output(carry: Mapping[str, object]) -> object:
    """What the last decoder layer returns, its hidden states in ``carry`` (whether it ran
    or was passed over): them alone, or with the causal LM's ``logits_to_keep`` where
    given."""
    hidden = carry[HIDDEN]
    return hidden if KEEP not in carry else {HIDDEN: hidden, KEEP: carry[KEEP]}


def _from(carry: Mapping[str, object], value: object) -> object:
    """``value``, or what the layer before handed on where it is a :class:`Handed`."""
    return carry[f"{_HANDED}{value.position}"] if isinstance(value, Handed) else value


class _BaseOutput:
    """What the base model's forward returns, for the causal LM's forward: the hidden
    states, and None for what a pipeline does not return (cache, attentions)."""

    def __init__(self, hidden: Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:
        return None


class _Returning:
    """Stands for the base model in the causal LM's forward: a call returns ``output``;
    its other attributes are the base model's (a family's forward reads its multipliers)."""

    __slots__ = ("base", "output")

    def __init__(self, base: nn.Module, output: _BaseOutput) -> None:
        self.base, self.output = base, output

    def __call__(self, *args: object, **kwargs: object) -> _BaseOutput:
        return self.output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


class Head(nn.Module):
    """What runs after the last decoder layer: the modules the base model's forward calls
    on the hidden states after its layers (the final norm), then the causal LM's forward
    (the head, logit scaling, soft-capping), as the family's own code. It returns the
    logits.

    It holds the modules after the layers and the causal LM's own children besides the
    one holding its base model, under the model's own names.
    """

    _model: nn.Module
    _base_path: str
    _tails: list[nn.Module]
    _casts: list[torch.dtype | None]

    def __init__(
        self,
        model: nn.Module,
        base_path: str,
        tail_paths: tuple[str, ...],
        head_children: tuple[str, ...],
        tail_casts: tuple[torch.dtype | None, ...] = (),
    ) -> None:
        super().__init__()
        top = base_path.partition(".")[0]
        inner = _relative(tail_paths, top)
        holder = model._modules[top]
        if inner and holder is not None:
            self.add_module(top, only(holder, inner))
        for name in head_children:
            self.add_module(name, model._modules[name])
        # The model is not this module's child (it holds the pipeline's pieces' modules):
        # set through __dict__, so that nn.Module's __setattr__ does not register it.
        self.__dict__["_model"] = model
        self.__dict__["_tails"] = [model.get_submodule(path) for path in tail_paths]
        self.__dict__["_casts"] = list(tail_casts) or [None] * len(tail_paths)
        self._base_path = base_path
        #: Whether the causal LM's forward is given ``input_ids`` of the hidden states'
        #: batch and length, on the meta device, for a family that reads their shape
        #: after its base model (Gemma 4's); set by the pipeline's probe.
        self.ids_shape = False

    def forward(self, carry: object) -> Tensor:
        hidden = carry[HIDDEN] if isinstance(carry, Mapping) else carry
        keep = carry.get(KEEP) if isinstance(carry, Mapping) else None
        assert isinstance(hidden, Tensor)
        for module, cast in zip(self._tails, self._casts, strict=True):
            hidden = module(hidden if cast is None else hidden.to(cast))
        base = _Returning(self._model.get_submodule(self._base_path), _BaseOutput(hidden))
        model = stand_ins(self._model, self.training, {self._base_path: base})[""]
        kept: dict[str, object] = {} if keep is None else {KEEP: keep}
        if self.ids_shape:
            kept["input_ids"] = torch.empty(hidden.shape[:2], dtype=torch.long, device="meta")
        kept.update(no_router_logits(model))
        result = model.forward(use_cache=False, return_dict=True, **kept)
        logits = result.logits if hasattr(result, "logits") else result[0]
        assert isinstance(logits, Tensor)
        return logits


def causal_lm_total(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """The summed next-token loss: each position predicts the next label, ``ignore_index``
    labels (and the last position) count nothing; in float32 at least, as Hugging Face's
    causal LM loss upcasts (float64 stays float64)."""
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shifted_total(logits, shifted, ignore_index)


def causal_lm_count(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """How many next-token targets ``labels`` holds (the ones not ``ignore_index``)."""
    return (labels[..., 1:] != ignore_index).sum()


def shifted_total(logits: Tensor, shift_labels: Tensor, ignore_index: int = -100) -> Tensor:
    """The summed loss of each position against its target in ``shift_labels`` (the
    causal LM's ``shift_labels``: already the next tokens, not shifted here), as
    :func:`causal_lm_total`."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )


def shifted_count(shift_labels: Tensor, ignore_index: int = -100) -> Tensor:
    """How many targets ``shift_labels`` holds (the ones not ``ignore_index``)."""
    return (shift_labels != ignore_index).sum()
