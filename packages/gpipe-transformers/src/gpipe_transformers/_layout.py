"""Where a Hugging Face causal language model keeps its decoder layers: the layout.

A causal LM (``LlamaForCausalLM``) holds its decoder layers in one ``ModuleList``
(``model.layers``, ``transformer.h``, ``model.decoder.layers``, ``bert.encoder.layer``):
the one its configuration's pipeline plan names (``base_model_pp_plan``), or else the one
of as many layers as its configuration's ``num_hidden_layers`` (inside the model's
``get_decoder()`` where there are several). The rest is found by running the model once,
on a probe of three tokens with its layers replaced by ones that hand their hidden states
on (:func:`find_layout`): which module the causal LM's forward calls that holds the layers
(the *base*: ``model``, ``model.decoder``), and which modules the base's forward calls on
the hidden states after the last layer (the *tail*: the final norm, DeepSeek-V4's
``hc_head``). Everything else runs before the layers (embeddings, position embeddings,
masks, ALiBi biases), and the causal LM's forward after its base model (the head, logit
scaling, soft-capping).

It must not know pipelines: it says which modules are where, or refuses a model whose
layout it cannot find, or that a pipeline of its layers would not run as the model runs,
naming what it saw and what to do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ._stand_in import stand_ins

__all__ = ["Layout", "LayoutError", "Probe", "evaluating", "find_layout", "probe_inputs", "probing"]

#: What a refusal suggests: the docs' section on writing a model as a sequence.
WRITE_IT = (
    "write the model as an nn.Sequential of its parts and pipeline it with gpipe.GPipe "
    "(the docs' section 'Models gpipe.transformers does not pipeline')"
)


@dataclass(frozen=True)
class Handed:
    """Where a layer's argument is what the layer before it returned at ``position``
    (``layer``: that layer's index, where known)."""

    position: int
    layer: int = -1


class LayoutError(ValueError):
    """A model whose decoder layers or pipeline plan cannot be found, or that a pipeline
    cannot train to its own numbers."""


@dataclass(frozen=True)
class Probe:
    """What the causal LM gave on the probe (:func:`probe_inputs`) with its layers handing
    their hidden states on (in eval mode, without gradients), which the pipeline's pieces
    must give too: the logits' shape, and the logits (None for a model on the meta
    device, run on fake tensors)."""

    shape: tuple[int, ...]
    logits: Tensor | None


@dataclass(frozen=True)
class Layout:
    """Where a causal LM's parts are; paths are from the causal LM."""

    #: The causal LM.
    model: nn.Module
    #: The module its forward calls that holds the layers (``model``, ``transformer``,
    #: ``model.decoder``).
    base_path: str
    #: The decoder layers (a ``ModuleList``: ``model.layers``).
    layers_path: str
    #: The modules the base's forward calls on the hidden states after the last layer, in
    #: their order (``model.norm``).
    tail_paths: tuple[str, ...]
    #: What a layer returns: its hidden states (0), or a tuple (or list) of this many items
    #: whose first is the hidden states (``hidden_states, topk_indices = layer(...)``).
    outputs: int = 0
    #: What a layer hands the next, besides its hidden states: the position of the item it
    #: returns and the next layer's argument it becomes (a keyword, or a position among
    #: the arguments after the hidden states).
    handed: tuple[tuple[int, int | str], ...] = ()
    #: The probe the layout was found with.
    probe: Probe | None = None
    #: The dtype the base's forward casts the hidden states to before each module of the
    #: tail (None: none; a family that keeps its final norm in float32).
    tail_casts: tuple[torch.dtype | None, ...] = ()

    @property
    def base(self) -> nn.Module:
        """The base model."""
        return self.model.get_submodule(self.base_path)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers."""
        layers = self.model.get_submodule(self.layers_path)
        assert isinstance(layers, nn.ModuleList)
        return layers

    def head_children(self) -> tuple[str, ...]:
        """The causal LM's own children that hold neither the layers nor the base (the
        head)."""
        top = self.base_path.partition(".")[0]
        return tuple(name for name in self.model._modules if name != top)


def _suggestion(name: str) -> str:
    if name.endswith("Model"):
        return f"such as {name.removesuffix('Model')}ForCausalLM"
    return "(the class AutoModelForCausalLM builds)"


def find_layout(model: object) -> Layout:
    """The layout of the causal LM ``model``.

    Raises:
        TypeError: ``model`` is not a Hugging Face ``PreTrainedModel``.
        LayoutError: it is an encoder-decoder model or has no head; no single
            ``ModuleList`` of its decoder layers is found; its forward does not run as a
            sequence of its layers (it calls them other than at most once each in order, its
            layers hand the next one more than their hidden states, its base model does
            more after its last layer than calling modules on the hidden states, or also
            calls those modules between its layers); or it
            has a mixture-of-experts auxiliary loss. The message names what was looked
            for and seen, and what to do.
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
    if model.get_output_embeddings() is None:  # type: ignore[no-untyped-call]
        raise LayoutError(
            f"the model has no language-model head (get_output_embeddings() is None): pass "
            f"a causal LM {_suggestion(name)}, which holds this model and its head "
            f"(model: {name})"
        )
    layers_path = _layers_path(model)
    layers = model.get_submodule(layers_path)
    assert isinstance(layers, nn.ModuleList)
    seen: _Seen | None = None
    unlike: list[str] = []  # what the probe saw, where a trace ran to its end
    failures: list[str] = []  # where the family's code failed on the stand-ins
    for outputs in range(5):  # the hidden states, or a tuple of 1 to 4 items
        try:
            seen = _trace(model, layers_path, outputs)
        except _Unlike as error:
            unlike.append(str(error))
            continue
        except Exception as error:
            failures.append(f"{type(error).__name__}: {error}")
            continue
        break
    if seen is None:
        if unlike:
            why = unlike[0]
        elif any("values to unpack" in failure for failure in failures):
            why = (
                "its layers return more than their hidden states, and the family's forward "
                f"uses them otherwise than as the next layer's arguments ({failures[0]})"
            )
        else:
            why = failures[0]
        raise LayoutError(
            f"{name}'s forward does not run as a sequence of its decoder layers "
            f"{layers_path} ({len(layers)} {type(layers[0]).__name__}): run on a probe of "
            f"three tokens with each layer handing its hidden states on, {why}; "
            f"{WRITE_IT} (model: {name})"
        )
    return Layout(
        model,
        seen.base,
        layers_path,
        seen.tail,
        seen.outputs,
        seen.handed,
        seen.probe,
        seen.casts,
    )


def _layers_path(model: nn.Module) -> str:
    """The path of the model's decoder layers, or the refusal naming what was looked for."""
    name = type(model).__name__
    config: Any = model.config
    text = config.get_text_config(decoder=True)
    count = getattr(text, "num_hidden_layers", None)
    lists = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    plan = getattr(text, "base_model_pp_plan", None) or {}
    planned = [path for path, _ in lists if path.rpartition(".")[2] in plan]
    if len(planned) == 1:
        return str(planned[0])
    found = [path for path, module in lists if len(module) == count]
    if len(found) > 1:  # layers hold modules: a list of embeddings or heads does not
        composite = [path for path, module in lists if path in found and _composite(module)]
        found = composite or found
    if len(found) > 1:
        decoder = _decoder_path(model)
        inside = [path for path in found if decoder is not None and _under(path, decoder)]
        found = inside or found
    if len(found) > 1:  # the outermost: a vision tower's layers lie deeper
        depth = min(path.count(".") for path in found)
        found = [path for path in found if path.count(".") == depth]
    if len(found) == 1:
        return str(found[0])
    shown = ", ".join(f"{path} ({len(module)})" for path, module in lists) or "none"
    looked = "several" if len(found) > 1 else "none"
    raise LayoutError(
        f"no single ModuleList of {name}'s decoder layers: looked for the one its "
        f"configuration's pipeline plan (base_model_pp_plan) names, or one of "
        f"num_hidden_layers ({count}) layers, and found {looked} (ModuleLists: {shown}); "
        f"{WRITE_IT} (model: {name})"
    )


def _composite(layers: nn.ModuleList) -> bool:
    """Whether every item of ``layers`` holds modules of its own."""
    return all(next(layer.children(), None) is not None for layer in layers)


def _decoder_path(model: nn.Module) -> str | None:
    try:
        decoder = model.get_decoder()  # type: ignore[operator]
    except Exception:
        return None
    for path, module in model.named_modules():
        if module is decoder:
            return str(path)
    return None


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(f"{prefix}.")


_PROBE_BATCH = 2


class _Unlike(Exception):
    """The probe saw the forward run otherwise than as a sequence of its layers."""


@dataclass
class _Call:
    path: str
    args: tuple[Any, ...]
    parent: str | None  # the path of the module whose forward called it (None: unknown)
    output: Any = None


@dataclass
class _Seen:
    base: str
    tail: tuple[str, ...]
    casts: tuple[torch.dtype | None, ...]
    outputs: int
    handed: tuple[tuple[int, int | str], ...]
    probe: Probe


class Passer:
    """Stands for decoder layer ``index`` in a run of the family's code: gives ``note``
    what it is called with (``note(index, hidden, args, kwargs)``, which may end the run by
    raising) and hands its hidden states on, alone or first of ``outputs`` items (the others
    marked :class:`Handed`, to see where the forward puts them). Its other attributes are
    the layer's."""

    __slots__ = ("index", "layer", "note", "outputs")

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        outputs: int,
        note: Callable[[int, Any, tuple[object, ...], dict[str, object]], None],
    ) -> None:
        self.layer, self.index, self.outputs, self.note = layer, index, outputs, note

    def __call__(self, hidden: Any, *args: object, **kwargs: object) -> Any:
        self.note(self.index, hidden, args, kwargs)
        if not self.outputs:
            return hidden
        return (hidden, *(Handed(k, self.index) for k in range(1, self.outputs)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)


@contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """Where the probe runs: for a model with tensors on the meta device (built by
    from_pretrained before its layers are read), on fake tensors, so that the family's
    checks of its inputs' values are skipped as when it is traced."""
    if not any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def probe_inputs(model: nn.Module) -> dict[str, Tensor]:
    """The probe's inputs: two samples of three tokens."""
    try:
        weight = model.get_input_embeddings().weight  # type: ignore[operator]
        device = weight.device
        vocab = weight.shape[0]
    except Exception:
        device, vocab = next(model.parameters()).device, 4
    vocab = max(vocab, 1)
    # No attention mask: a model on the meta device (from_pretrained's, before its
    # layers are read) builds masks without reading one.
    # Of an odd length, so that a family that pads its inputs to a multiple of a block
    # (and drops the padding after its layers) is seen doing it.
    ids = torch.tensor([[1, 2, 3], [3, 1, 2]], device=device)
    assert ids.shape[0] == _PROBE_BATCH
    return {"input_ids": ids.clamp(max=vocab - 1)}


def no_router_logits(model: nn.Module) -> dict[str, bool]:
    """What a call of the family's own code around its layers is given so that it collects
    no router logits where the config asks for them (the stand-ins record none: the
    pipeline computes the router loss itself, see :mod:`._router`)."""
    return (
        {"output_router_logits": False} if getattr(model.config, "output_router_logits", 0) else {}
    )


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode and without gradients inside, in its own modes after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def _trace(model: nn.Module, layers_path: str, outputs: int) -> _Seen:
    """Run ``model`` on the probe with its layers handing their hidden states on, and
    note which module holds them and which modules run on the hidden states after them."""
    layers = model.get_submodule(layers_path)
    assert isinstance(layers, nn.ModuleList)
    log: list[Any] = []

    def note(index: int, hidden: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        log.append(("layer", index, hidden, args, kwargs))

    passers = [Passer(layer, k, outputs, note) for k, layer in enumerate(layers)]
    made = stand_ins(model, False, {layers_path: passers})
    paths = {id(module): path for path, module in made.items()}
    inside = f"{layers_path}."
    for path, module in model.named_modules():
        if not path.startswith(inside) and path != layers_path:
            paths.setdefault(id(module), path)
    on_way = {id(module) for path, module in made.items() if path}
    thread = threading.get_ident()
    stack: list[_Call] = []

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() != thread:
            return
        path = paths.get(id(module))
        parent = stack[-1].path if stack else None
        call = _Call(path if path is not None else "?", args, parent)
        if id(module) in on_way or path is not None:
            log.append(("call", call))
        stack.append(call)

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if threading.get_ident() != thread:
            return
        call = stack.pop()
        call.output = output
        if id(module) in on_way:
            log.append(("return", call))

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(before),
        nn.modules.module.register_module_forward_hook(after),
    ]
    try:
        with evaluating(model), probing(model):
            output = made[""].forward(
                **probe_inputs(model), use_cache=False, return_dict=True, **no_router_logits(model)
            )
            logits = output.logits if hasattr(output, "logits") else output[0]
            probe = Probe(tuple(logits.shape), None if logits.device.type == "meta" else logits)
            return _read(log, layers_path, len(layers), outputs, probe)
    finally:
        for hook in hooks:
            hook.remove()


def _read(log: list[Any], layers_path: str, count: int, outputs: int, probe: Probe) -> _Seen:
    """The base and tail the probe's log shows, or why the forward is not a sequence."""
    order = [event[1] for event in log if event[0] == "layer"]
    # Each layer at most once, in order: a layer the family's forward passes over (Mllama's
    # cross-attention layers without images) is passed over in the pipeline too.
    if not order:
        raise _Unlike(f"it called none of its {count} layers")
    if order != sorted(set(order)):
        raise _Unlike(
            f"its layers were called in the order {order[:12]}, not each at most once in "
            f"order (0 to {count - 1})"
        )
    handed = [event[2] for event in log if event[0] == "layer"]
    first = handed[0]
    if not isinstance(first, Tensor) or first.dim() < 2 or first.shape[0] != _PROBE_BATCH:
        shape = tuple(first.shape) if isinstance(first, Tensor) else type(first).__name__
        raise _Unlike(
            f"its first layer was given hidden states of shape {shape}, which do not carry "
            f"the probe's {_PROBE_BATCH} samples in their first dimension (a pipeline splits "
            "the batch there)"
        )
    for call in range(1, len(order)):
        before, index = order[call - 1], order[call]
        if handed[call] is not handed[call - 1]:
            raise _Unlike(
                f"layer {index} was not given the hidden states layer {before} returned "
                "(its layers hand the next one more than their hidden states, or the "
                "forward changes them between layers)"
            )
    handed_on = _handed(log)
    calls = [event[1] for event in log if event[0] == "call"]
    ways = [c for c in calls if c.path and _under(layers_path, c.path) and c.path != layers_path]
    if not ways:
        raise _Unlike(f"no module holding {layers_path} was called by the causal LM's forward")
    base = ways[0]
    last = max(k for k, event in enumerate(log) if event[0] == "layer")
    end = next((k for k, e in enumerate(log) if e[0] == "return" and e[1] is base), len(log))
    on_way = {c.path for c in ways}
    tail = [
        event[1]
        for event in log[last + 1 : end]
        if event[0] == "call" and event[1].parent in on_way and event[1].path not in on_way
    ]
    hidden = handed[-1]
    casts: list[torch.dtype | None] = []
    chain = []
    for call in tail:
        given = call.args[0] if len(call.args) == 1 else None
        cast = given.dtype if isinstance(given, Tensor) and given.dtype != hidden.dtype else None
        if given is None or not _same(given, hidden if cast is None else hidden.to(cast)):
            # Not on the hidden states (a pooler of the first position): what it gives
            # must not reach them, which the check of what the forward returns sees.
            continue
        chain.append(call)
        casts.append(cast)
        hidden = call.output
    tail = chain
    result = base.output
    final = getattr(result, "last_hidden_state", None)
    if final is None and isinstance(result, (tuple, list)) and result:
        final = result[0]
    if not isinstance(final, Tensor) or not _same(final, hidden):
        names = [call.path for call in tail] or "none"
        raise _Unlike(
            f"the hidden states {base.path}'s forward returns are not what its modules after "
            f"the last layer ({names}) give: it computes more than their calls"
        )
    paths = tuple(call.path for call in tail)
    # A pipeline's embeddings end the forward at the first module after the layers where
    # it passes over its last layers (see _pieces.Embed): none may run between them.
    first_layer = next(k for k, event in enumerate(log) if event[0] == "layer")
    between = sorted(
        {e[1].path for e in log[first_layer:last] if e[0] == "call" and e[1].path in paths}
    )
    if between:
        raise _Unlike(
            f"its modules after the last layer ({', '.join(between)}) also run between its layers"
        )
    return _Seen(base.path, paths, tuple(casts), outputs, handed_on, probe)


def _handed(log: list[Any]) -> tuple[tuple[int, int | str], ...]:
    """Where each layer's arguments hold what the layer called before it returned besides
    its hidden states: the same for every layer, or the refusal."""
    given = [(event[1], event[3], event[4]) for event in log if event[0] == "layer"]
    found: set[tuple[int, int | str]] = set()
    for call, (index, args, kwargs) in enumerate(given):
        before = given[call - 1][0] if call else -1
        seen: set[tuple[int, int | str]] = set()
        places: list[tuple[int | str, object]] = [*enumerate(args), *kwargs.items()]
        for where, value in places:
            if isinstance(value, Handed):
                if value.layer != before:
                    raise _Unlike(
                        f"layer {index} was given what layer {value.layer} returned, not "
                        f"only what the layer called before it did"
                    )
                seen.add((value.position, where))
        if call == 1:
            found = seen
        elif call > 1 and seen != found:
            raise _Unlike(
                f"layer {index} was given other items of what the layer before returned "
                f"than layer {given[1][0]} ({sorted(map(str, seen))}, not "
                f"{sorted(map(str, found))})"
            )
    return tuple(sorted(found, key=str))


def _same(value: object, hidden: object) -> bool:
    """Whether ``value`` is ``hidden``, or a view of it of the same shape (a family's
    ``.view(output_shape)``)."""
    if value is hidden:
        return True
    if not isinstance(value, Tensor) or not isinstance(hidden, Tensor):
        return False
    if value.shape != hidden.shape or value.dtype != hidden.dtype:
        return False
    return value.device.type == "meta" or bool(torch.equal(value, hidden))
