"""Generation through a pipeline: :func:`generate`, which :meth:`CausalLMPipe.generate
<gpipe_transformers.CausalLMPipe.generate>` runs.

The model's own ``generate`` prepares everything as it does for itself (the generation
config and its defaults, special tokens, the attention mask, the position ids, the logits
processors and the stopping criteria) and hands them to a decoding loop of the caller's (its
``custom_generate``), here one that only keeps them (:class:`_Prepared`): for the whole
batch, and for each lane alone (some processors hold a value per sequence). The batch is
split into the pipeline's micro-batches, its lanes, and run with :meth:`GPipe.decode
<gpipe_core.GPipe.decode>`: the prompt (the first round) and every new token after it,
each partition keeping its own layers' cache per lane (:mod:`._pieces`). On the last
partition each lane does with its logits what transformers' own sampling loop does with the
whole batch's: the logits processors, the greedy or sampled token, padding once a sequence
has stopped, the stopping criteria. A lane whose sequences have all stopped stops.

It must not know partitions or transports: the pipeline's decode run carries the lanes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from ._pieces import KEEP, new_cache
from ._shown import shown

__all__ = ["Pipe", "generate"]


class Pipe(Protocol):
    """What generation asks of a pipeline (:class:`~gpipe_transformers.CausalLMPipe` is
    one)."""

    @property
    def causal_lm(self) -> nn.Module:
        """The causal LM the pipeline runs."""

    @property
    def chunks(self) -> int:
        """How many lanes a batch is split into."""

    def decode(self, *inputs: Any, **options: Any) -> object:
        """:meth:`GPipe.decode <gpipe_core.GPipe.decode>`."""


# generate's options that a pipeline does not honour, refused before anything runs.
_REFUSED = {
    "assistant_model": "assisted decoding is not supported",
    "assistant_tokenizer": "assisted decoding is not supported",
    "streamer": "streaming is not supported",
    "synced_gpus": "a pipeline's ranks are synchronised by the pipeline",
    "custom_generate": "the pipeline runs its own decoding loop",
    "inputs_embeds": "a pipeline generates from input_ids",
    "cache": "the pipeline keeps each partition's cache itself",
    "past_key_values": "the pipeline keeps each partition's cache itself",
}
# What a pipeline does not return, refused from the generation config the model's generate
# prepares (the options and a GenerationConfig alike).
_FLAGS = (
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
)


def generate(pipe: Pipe, inputs: Tensor | None, options: dict[str, Any]) -> Tensor:
    """``pipe.causal_lm.generate(inputs, **options)``'s sequences, generated through ``pipe``
    (see :meth:`CausalLMPipe.generate <gpipe_transformers.CausalLMPipe.generate>`)."""
    for name, value in options.items():
        if name in _REFUSED and value is not None and value is not False:
            raise ValueError(
                f"{name} is not supported by a pipeline's generate: {_REFUSED[name]} "
                f"({name}: {shown(value)})"
            )
    if options.get("use_cache") is False:
        raise ValueError(
            "use_cache=False is not supported: a pipeline generates with each partition's "
            "cache (use_cache: False)"
        )
    model = pipe.causal_lm
    # Refused before the model's generate prepares anything: a family whose cache the
    # pipeline does not keep.
    new_cache(model.config)
    options = {key: value for key, value in options.items() if value is not None}
    whole = _Prepared.of(model, inputs, options)
    size = len(whole.input_ids)
    lanes = len(whole.input_ids.chunk(pipe.chunks))
    if lanes == 1:
        each = [whole]
    else:
        # Each lane's logits processors and stopping criteria are made for its own
        # sequences, as the model's generate makes them for a batch of them (some hold a
        # value per sequence); the model's inputs are the whole batch's, split.
        each = [
            _Prepared.of(model, *_lane_call(inputs, options, size, pipe.chunks, k))
            for k in range(lanes)
        ]
    return _run(pipe, whole, each)


def _lane_call(
    inputs: Tensor | None, options: dict[str, Any], size: int, chunks: int, k: int
) -> tuple[Tensor | None, dict[str, Any]]:
    """The arguments of the model's generate for lane ``k`` alone: the tensors of the
    batch (its inputs, masks, position ids) split as the pipeline splits the batch."""

    def lane(value: object) -> object:
        if isinstance(value, Tensor) and value.dim() and len(value) == size:
            return value.chunk(chunks)[k]
        return value

    return cast(Tensor | None, lane(inputs)), {key: lane(value) for key, value in options.items()}


@dataclass
class _Prepared:
    """What the model's generate prepares for a batch of prompts and hands its decoding
    loop: the prompts' ids, the logits processors, the stopping criteria, the generation
    config and the model's keyword inputs (attention mask, position ids)."""

    input_ids: Tensor
    logits_processor: Any
    stopping_criteria: Any
    generation_config: Any
    model_kwargs: dict[str, Any]

    @classmethod
    def of(cls, model: nn.Module, inputs: Tensor | None, options: dict[str, Any]) -> _Prepared:
        """What ``model.generate(inputs, **options)`` prepares (nothing runs the model),
        or the refusal of what a pipeline does not generate."""
        found: list[_Prepared] = []

        def loop(
            model: nn.Module,
            input_ids: Tensor,
            logits_processor: Any,
            stopping_criteria: Any,
            generation_config: Any,
            **model_kwargs: Any,
        ) -> Tensor:
            _check_mode(generation_config)
            found.append(
                cls(input_ids, logits_processor, stopping_criteria, generation_config,
                    model_kwargs)
            )  # fmt: skip
            return input_ids

        generate = cast(Callable[..., object], model.generate)
        generate(inputs, custom_generate=loop, **options)
        return found[0]


def _check_mode(generation_config: Any) -> None:
    # Local, as the package's other imports of transformers: importing gpipe_transformers
    # does not import transformers' generation.
    from transformers.generation.configuration_utils import GenerationMode

    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            "a pipeline generates greedily or by sampling, one sequence per prompt "
            f"(num_beams=1, no assistant): the options ask for {mode.value} (num_beams: "
            f"{generation_config.num_beams}, penalty_alpha: "
            f"{generation_config.penalty_alpha}, dola_layers: "
            f"{generation_config.dola_layers})"
        )
    for flag in _FLAGS:
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"{flag} is not supported by a pipeline's generate: a pipeline returns "
                f"the sequences only ({flag}: True)"
            )


@dataclass
class _Lane:
    """A lane's generation, on the last partition's process: its sequences so far, the
    model's keyword inputs (attention mask, position ids), which sequences go on, and its
    own logits processors and stopping criteria."""

    ids: Tensor
    mask: Tensor | None
    positions: Tensor | None
    unfinished: Tensor
    processors: Any
    criteria: Any


def _run(pipe: Pipe, whole: _Prepared, each: list[_Prepared]) -> Tensor:
    """Generate through ``pipe`` the sequences ``whole`` prepares, each lane with the
    processors and criteria of its ``each``."""
    kwargs = dict(whole.model_kwargs)
    # The cache the model's generate made for itself is not used: each partition keeps
    # its own layers' cache per lane.
    for name in ("cache", "past_key_values", "use_cache", "synced_gpus", "streamer", "tokenizer"):
        kwargs.pop(name, None)
    mask: Tensor | None = kwargs.pop("attention_mask", None)
    positions: Tensor | None = kwargs.pop("position_ids", None)
    keep = kwargs.pop(KEEP, None)
    others = {key: value for key, value in kwargs.items() if value is not None}
    if others:
        raise TypeError(
            f"{', '.join(sorted(others))} is not an input a pipeline's generate takes: it "
            "generates from input_ids, attention_mask and position_ids"
        )
    input_ids, config = whole.input_ids, whole.generation_config
    rounds = int(config.max_length) - input_ids.shape[1]
    if rounds < 1:
        raise ValueError(
            "nothing to generate: the prompts are already max_length long (prompt "
            f"length: {input_ids.shape[1]}, max_length: {config.max_length})"
        )
    pad = config._pad_token_tensor
    eos = any(hasattr(criteria, "eos_token_id") for criteria in whole.stopping_criteria)
    do_sample = bool(config.do_sample)
    size, chunks = len(input_ids), pipe.chunks
    lanes = [
        _Lane(ids, lane_mask, lane_positions, ids.new_ones(len(ids)),
              prepared.logits_processor, prepared.stopping_criteria)
        for ids, lane_mask, lane_positions, prepared in zip(
            input_ids.chunk(chunks), _chunks(mask, chunks, size),
            _chunks(positions, chunks, size), each, strict=True,
        )
    ]  # fmt: skip

    def feedback(lane: int, round: int, logits: Tensor) -> dict[str, Any] | None:
        state = lanes[lane]
        ids = state.ids
        # As transformers' sampling loop: the last position's logits, in float32.
        scores = logits[:, -1].to(copy=True, dtype=torch.float32, device=ids.device)
        scores = state.processors(ids, scores)
        if do_sample:
            probabilities = nn.functional.softmax(scores, dim=-1)
            tokens = torch.multinomial(probabilities, num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if eos:
            tokens = tokens * state.unfinished + pad * (1 - state.unfinished)
        state.ids = ids = torch.cat([ids, tokens[:, None]], dim=-1)
        state.unfinished = state.unfinished & ~state.criteria(ids, None)
        if state.unfinished.max() == 0:
            return None
        if state.mask is not None:
            state.mask = torch.cat([state.mask, state.mask.new_ones((len(ids), 1))], dim=-1)
        if state.positions is not None:
            state.positions = torch.cat([state.positions, state.positions[..., -1:] + 1], -1)
        return _inputs(tokens[:, None], state.mask, state.positions, keep, last=True)

    def result() -> list[list[int]]:
        length = max(state.ids.shape[1] for state in lanes)
        rows: list[list[int]] = []
        for state in lanes:
            ids = state.ids
            if ids.shape[1] < length:  # a lane that stopped first: padded, as generate pads
                padding = ids.new_full((len(ids), length - ids.shape[1]), int(pad))
                ids = torch.cat([ids, padding], dim=-1)
            rows.extend(ids.tolist())
        return rows

    first = _inputs(input_ids, mask, positions, keep, last=False)
    agreed = {"generation options": _options(config, input_ids.shape)}
    rows = pipe.decode(feedback=feedback, rounds=rounds, agree=agreed, result=result, **first)
    return torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)


def _chunks(value: Tensor | None, chunks: int, size: int) -> list[Tensor | None]:
    """``value`` split as the pipeline splits the batch (None: one None per lane)."""
    if value is None:
        return [None] * len(range(0, size, -(-size // chunks)))
    return list(value.chunk(chunks))


def _inputs(
    ids: Tensor, mask: Tensor | None, positions: Tensor | None, keep: object, *, last: bool
) -> dict[str, Any]:
    """The base model's keyword inputs of a round: the new positions' ids, the mask of the
    whole sequence so far, the new positions' position ids, the logits to keep (as
    transformers' ``prepare_inputs_for_generation`` gives them)."""
    inputs: dict[str, Any] = {"input_ids": ids}
    if mask is not None:
        inputs["attention_mask"] = mask
    if positions is not None:
        inputs["position_ids"] = positions[..., -ids.shape[1] :] if last else positions
    if keep is not None:
        inputs[KEEP] = keep
    return inputs


def _options(config: Any, shape: object) -> str:
    """The generation options every rank must agree on, as text."""
    fields = config.to_diff_dict() if hasattr(config, "to_diff_dict") else {}
    shown = {key: fields[key] for key in sorted(fields) if not key.startswith("_")}
    return f"prompts of shape {tuple(shape)}; {shown}"  # type: ignore[arg-type]
