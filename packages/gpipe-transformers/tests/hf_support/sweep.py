"""Every causal LM family of the installed transformers, built tiny and pipelined: the sweep.

:func:`tiny_config` shrinks a family's default configuration by the names of its sizes
(the same rules for every family: layers, heads, widths, experts, vocabulary), not by a
table per family. :func:`outcome` builds the model in float64, pipelines it over two
partitions at ``chunks=4`` on a padded batch, and compares its loss, gradients and logits
with the plain model's, whose labels loss is computed from its logits in float64.
"""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

VOCAB = 96
#: Input ids are drawn below this, so that a family's special tokens (images, audio) set
#: above it are never in a batch.
IDS = 64
LENGTH = 8
SIZE = 8
CHUNKS = 4
LAYERS = 4
EXACT = 1e-10

# The rules of the shrinker, first match wins: a pattern over an integer field's name and
# the value it gets. A field is shrunk only when larger than its new value.
_RULES: tuple[tuple[str, int], ...] = (
    (r"((^|_)vocab_size($|_per_layer_input$)|_group_vocab$)", VOCAB),
    (
        r"^(num_hidden_layers|n_layers?|num_layers|(en|de)coder_layers|num_(en|de)coder_layers)$",
        LAYERS,
    ),
    (r"layer_period$", 2),
    (r"layer_offset$", 1),
    (r"(key_value_heads|kv_heads|num_query_groups)$", 2),
    (r"(^|_)(n_heads?|num_heads|attention_heads|num_attention_heads)$", 2),
    (r"^(linear_num_(key|value)_heads|mamba_n_heads|mamba_num_heads|index_n_heads)$", 2),
    (r"^qk_head_dim$", 16),  # qk_nope_head_dim + qk_rope_head_dim
    (r"(^|_)(head_dim|d_head|dim_head|head_size|attention_head_dim|kv_channels|d_rel)$", 8),
    (r"^(v_head_dim|index_head_dim)$", 8),
    (r"^block_size$", 2),
    (r"^(linear_key_head_dim|linear_value_head_dim|linear_head_dim|mamba_d_head)$", 8),
    (r"^(q_lora_rank|kv_lora_rank|o_lora_rank|hc_lowrank|laurel_rank|gated_norm_rank)$", 8),
    (r"(moe_intermediate_size|expert_ffn_hidden_size|shared_expert.*_size)$", 16),
    (r"(intermediate_size.*|ffn_dim|ffn_hidden_size|^dff|dim_ff|n_inner|d_inner)$", 32),
    (r"(feed_forward_size|intermediate_size_mlp|dense_intermediate_size)$", 32),
    (r"^(hidden_size|d_model|n_embd|n_embed|embed_dim|embedding_size|dim|emb_dim)$", 16),
    (
        r"^(hidden_size_global|adapter_(in|out)_dim|adapter_(input|output)_size|downsample_hidden_size)$",
        16,
    ),
    (r"^(word_embed_proj_dim|lru_width|backbone_hidden_size)$", 16),
    (r"^(embedding_dim|input_embedding_size|output_embedding_size)$", 16),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$", 4),
    (r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k)$", 2),
    (r"^(n_shared_experts|num_shared_experts)$", 1),
    (r"^(n_group|topk_group|num_expert_group|n_groups|mamba_n_groups|mamba_ngroups)$", 1),
    (r"^num_kv_shared_layers$", 2),
    (r"(^|_)expand$", 1),
    (r"^layer_group_size$", 2),
    (r"^(state_size|mamba_d_state|ssm_state_size|time_step_rank|mamba_dt_rank)$", 8),
    (r"^(rotary_dim|partial_rotary_dim)$", 4),
    (r"(max_position_embeddings|n_positions|max_target_positions|n_ctx|max_seq_len)$", 64),
)
_COMPILED = tuple((re.compile(pattern), value) for pattern, value in _RULES)
_SPECIAL = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def _small(name: str, value: int) -> int:
    for pattern, small in _COMPILED:
        if pattern.search(name):
            return min(value, small)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Sizes a family's default may leave unset (None) and its model still read.
_UNSET = re.compile(
    r"^(head_dim|num_key_value_heads|num_experts_per_tok|n_routed_experts|n_shared_experts)$"
)
# Layer counts are set, not only shrunk: an encoder-decoder family's decoder keeps a cache
# of as many layers as its encoder has.
_COUNTS = re.compile(r"^((en|de)coder_layers|num_(en|de)coder_layers)$")


def _kinds(values: list[Any]) -> list[Any]:
    """The first layers' values of a list of one per layer, keeping each kind of layer
    the list has (a hybrid model's attention and linear-attention layers): the kinds in
    the order they first appear, repeated."""
    kinds: dict[str, Any] = {}
    for value in values:
        kinds.setdefault(repr(value), value)
    order = list(kinds.values())
    return [order[index % len(order)] for index in range(LAYERS)]


def _per_layer_dict(value: object) -> bool:
    """Whether ``value`` is a dict of one entry of settings per layer, by index."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in value)
        and all(isinstance(v, dict) for v in value.values())
    )


def _kept_layers(values: dict[str, Any], layers: int) -> list[int]:
    """The layers kept where settings are given per layer (overrides by index): the first
    of each kind (what every per-layer list and dict says of it together), then the first
    others, in order."""
    lists = [v for v in values.values() if isinstance(v, list) and len(v) == layers]
    dicts = [{int(k): v for k, v in d.items()} for d in values.values() if _per_layer_dict(d)]
    kinds: dict[str, int] = {}
    for index in range(layers):
        kind = repr([*(v[index] for v in lists), *(d.get(index) for d in dicts)])
        kinds.setdefault(kind, index)
    kept = sorted(kinds.values())[:LAYERS]
    rest = [index for index in range(layers) if index not in kept]
    return sorted(kept + rest[: LAYERS - len(kept)])


def _summed_dims(default: dict[str, Any], new: dict[str, Any]) -> dict[str, int]:
    """A head dimension that is the sum of the query-key parts in ``default`` (MLA's
    ``qk_nope_head_dim + qk_rope_head_dim``), the sum of their shrunk values in ``new``."""
    dims = [k for k, v in default.items() if k.endswith("head_dim") and _is_int(v)]
    parts = [k for k in dims if k.startswith("qk_")]
    sums: dict[str, int] = {}
    for total in (k for k in dims if k not in parts):
        for a in parts:
            for b in parts:
                if len({total, a, b}) == 3 and a < b and default[total] == default[a] + default[b]:
                    sums[total] = new[a] + new[b]
    return {k: v for k, v in sums.items() if v != new[k]}


def _layer_count(values: dict[str, Any]) -> int | None:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if _is_int(values.get(name)):
            return values[name]
    return None


def _shrunk(values: dict[str, Any]) -> dict[str, Any]:
    """The fields of a configuration's dict to override, by the rules: sizes by their
    names, lists of one value per layer cut to the first layers, per-layer dicts to the
    layers kept (sub-configurations shrunk the same way)."""
    changed: dict[str, Any] = {}
    layers = _layer_count(values)
    per_layer = [name for name, value in values.items() if _per_layer_dict(value)]
    if per_layer and layers is not None and layers > LAYERS:
        kept = _kept_layers(values, layers)
        for name, value in values.items():
            if isinstance(value, list) and len(value) == layers:
                changed[name] = [
                    _small(name, value[k]) if _is_int(value[k]) else value[k] for k in kept
                ]
        top = {**values, **{k: _small(k, v) for k, v in values.items() if _is_int(v)}}
        for name in per_layer:
            value = values[name]
            width = max(len(str(k)) for k in value)
            by_index = {int(k): v for k, v in value.items()}
            renumbered = {}
            for new, old in enumerate(kept):
                if old in by_index:
                    override = {**by_index[old], **_shrunk(by_index[old])}
                    merged_default = {**values, **by_index[old]}
                    merged_new = {**top, **override}
                    override.update(_summed_dims(merged_default, merged_new))
                    key = str(new).zfill(width) if isinstance(next(iter(value)), str) else new
                    renumbered[key] = override
            changed[name] = renumbered
    for name, value in values.items():
        if name in changed:
            continue
        if (
            isinstance(value, dict)
            and value
            and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in value)
        ):
            kept = {k: v for k, v in value.items() if int(k) < LAYERS}
            if len(kept) != len(value):
                changed[name] = kept
        elif isinstance(value, dict) and name.endswith("config"):
            changed[name] = {**value, **_shrunk(value)}
        elif isinstance(value, list) and layers is not None and len(value) == layers > LAYERS:
            changed[name] = [_small(name, v) if _is_int(v) else v for v in _kinds(value)]
        elif _is_int(value) and _COUNTS.search(name):
            changed[name] = LAYERS
        elif _is_int(value) and _small(name, value) != value:
            changed[name] = _small(name, value)
        elif value is None and _UNSET.search(name):
            changed[name] = _small(name, 1 << 30)  # a size the family reads, left unset
    _keep_grouping(values, changed)
    for name, value in values.items():
        # A choice the family's forward needs that its default leaves unset (X-MOD's
        # default_language): the first of the ones its configuration lists.
        options = values.get(name.removeprefix("default_") + "s")
        if value is None and name.startswith("default_") and isinstance(options, (list, tuple)):
            changed.update({name: options[0]} if options else {})
    for offset, name in enumerate(_SPECIAL):
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= IDS:
            changed[name] = offset
    return changed


def _keep_grouping(values: dict[str, Any], changed: dict[str, Any]) -> None:
    """Key-value heads in the default's proportion to the attention heads (at least one):
    a family that doubles them on some layers (MiMo's sliding ones) keeps no more of them
    than attention heads."""
    heads, groups = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if not (_is_int(heads) and _is_int(groups) and "num_key_value_heads" in changed):
        return
    shrunk = changed.get("num_attention_heads", heads)
    changed["num_key_value_heads"] = min(
        changed["num_key_value_heads"], max(1, shrunk * groups // heads)
    )


def tiny_config(model_type: str) -> Any:
    """The configuration of a tiny ``model_type`` model: its default, shrunk."""
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    # The causal heads of encoder families (BERT's, BART's decoder) decode only as decoders.
    made = transformers.AutoConfig.for_model(
        model_type, **{"is_decoder": True, **_shrunk(default.to_dict())}
    )
    # A causal LM of a composite family takes its own part of the configuration
    # (Musicgen's decoder), shrunk the same way.
    own = getattr(_causal_class(model_type), "config_class", None)
    if own is not None and not isinstance(made, own):
        parts = [value for value in vars(made).values() if isinstance(value, own)]
        if len(parts) == 1:
            values = parts[0].to_dict()
            return own(**{**values, "is_decoder": True, **_shrunk(values)})
    return made


def _causal_class(model_type: str) -> Any:
    """The causal LM class ``AutoModelForCausalLM`` builds for ``model_type``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


# Float64, and experts computed one by one (transformers' grouped matmul takes no float64).
_FLOAT64: dict[str, Any] = {"dtype": torch.float64, "experts_implementation": "eager"}


def build(model_type: str, seed: int = 0, **overrides: object) -> nn.Module:
    """The tiny ``model_type`` causal LM (``AutoModelForCausalLM``'s) in float64 (sdpa, or
    eager where the family has no sdpa), in training mode without dropout; ``overrides``
    set fields of its configuration."""
    config = tiny_config(model_type)
    for name, value in overrides.items():
        setattr(config, name, value)
    causal = _causal_class(model_type)
    for name, value in list(vars(config).items()):
        if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)
    torch.manual_seed(seed)
    try:
        built = causal._from_config(config, attn_implementation="sdpa", **_FLOAT64)
    except (ValueError, ImportError):
        torch.manual_seed(seed)
        built = causal._from_config(config, attn_implementation="eager", **_FLOAT64)
    built.train()
    return built


def padded_batch(seed: int = 0, pad: bool = True) -> dict[str, Tensor]:
    """``input_ids``, a right-padding ``attention_mask`` (every other sample padded) and
    ``labels`` (-100 where padded); without ``pad``, ``input_ids`` and ``labels``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IDS, (SIZE, LENGTH), generator=generator)
    if not pad:
        return {"input_ids": ids, "labels": ids.clone()}
    mask = torch.ones(SIZE, LENGTH, dtype=torch.long)
    for row in range(0, SIZE, 2):
        mask[row, LENGTH - 1 - row // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def labels_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The mean next-token cross entropy over the labels that are not -100, in the
    logits' dtype (float64)."""
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


@dataclass
class Outcome:
    """What the sweep saw for one family."""

    #: ``exact``, ``refused`` (gpipe's LayoutError or ValueError before anything ran),
    #: ``plain fails`` (the plain model does not build or run: not gpipe's), or ``wrong``
    #: (gpipe ran and differed, or failed inside a step).
    kind: str
    detail: str = ""


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def outcome(model_type: str, balance: tuple[int, ...] = (2, 2), **overrides: object) -> Outcome:
    """Build ``model_type`` tiny (``overrides`` set fields of its configuration), pipeline
    it over ``balance``, and compare it with the plain model."""
    from gpipe_transformers import LayoutError, pipeline

    try:
        built = build(model_type, **overrides)
        # A family whose forward takes no attention mask (xLSTM) gets no padding.
        data = padded_batch(pad="attention_mask" in inspect.signature(built.forward).parameters)
        inputs = {k: v for k, v in data.items() if k != "labels"}
        plain, spare = copy.deepcopy(built), copy.deepcopy(built)
        if not _deterministic(spare, inputs):
            # A family that samples in training (a router's noise): compared in eval mode.
            for model in (built, plain, spare):
                model.eval()
        logits = plain(**inputs, use_cache=False).logits
        loss = labels_loss(logits, data["labels"])
        loss.backward()
    except Exception as error:
        return Outcome("plain fails", f"{type(error).__name__}: {error}"[:300])
    whole = _grads(plain)
    try:
        pipe = pipeline(built, balance=list(balance), chunks=CHUNKS)
    except (LayoutError, ValueError, TypeError) as error:
        return Outcome("refused", f"{type(error).__name__}: {error}")
    try:
        losses = pipe.step(**data)
        out = pipe(**inputs)
    except Exception as error:
        return Outcome("wrong", f"fails inside a step: {type(error).__name__}: {error}"[:300])
    if out.shape != logits.shape:
        return Outcome("wrong", f"logits {tuple(out.shape)}, the model's {tuple(logits.shape)}")
    problems = []
    mine = _grads(built)
    off = {
        "loss": abs(losses.reduced().item() - loss.item()),
        "logits": (out.detach() - logits.detach()).abs().max().item(),
        **{n: (mine[n] - whole[n]).abs().max().item() for n in whole if n in mine},
    }
    if set(mine) != set(whole):
        problems.append(f"gradients of other parameters: {sorted(set(mine) ^ set(whole))[:4]}")
    # Exact: within 1e-10 of the value's size (at least 1).
    scale = {n: EXACT * max(1.0, _size(whole.get(n), loss, logits, n)) for n in off}
    if set(mine) == set(whole) and not all(d <= scale[n] for n, d in off.items()):
        # Within a small multiple of the plain model's own micro-batched difference: a
        # family that computes in float32 inside a float64 model.
        limit = _micro_batched_limit(spare, data, loss.item(), logits.detach(), whole)
        over = [n for n, d in off.items() if not d <= max(scale[n], 4 * limit.get(n, 0.0))]
        if over:
            problems.append(
                ", ".join(
                    f"{n} off by {off[n]:.1e} (micro-batched: {limit[n]:.1e})" for n in over[:3]
                )
            )
    if problems:
        return Outcome("wrong", "; ".join(problems))
    return Outcome("exact")


def _size(grad: Tensor | None, loss: Tensor, logits: Tensor, name: str) -> float:
    """The size of what ``name`` compares: the loss, the logits, or a gradient."""
    if name == "loss":
        return abs(loss.item())
    value = logits if name == "logits" else grad
    return value.detach().abs().max().item() if value is not None and value.numel() else 0.0


def _deterministic(model: nn.Module, inputs: dict[str, Tensor]) -> bool:
    """Whether ``model`` gives the same logits twice in its mode."""
    with torch.no_grad():
        torch.manual_seed(1)
        one = model(**inputs, use_cache=False).logits
        torch.manual_seed(2)
        return bool(torch.equal(one, model(**inputs, use_cache=False).logits))


def _micro_batched_limit(
    spare: nn.Module,
    data: dict[str, Tensor],
    loss: float,
    logits: Tensor,
    whole: dict[str, Tensor],
) -> dict[str, float]:
    """How far the plain model's own loss, logits and gradients over the pipeline's
    micro-batches are from its whole batch's (per parameter): what a family that
    computes in float32 inside a float64 model differs by in its own code."""
    model = spare
    labels = data["labels"]
    count = (labels[:, 1:] != -100).sum()
    summed = 0.0
    parts = []
    chunked = [
        {k: v.chunk(CHUNKS)[n] for k, v in data.items() if k != "labels"} for n in range(CHUNKS)
    ]
    for piece_inputs, part in zip(chunked, labels.chunk(CHUNKS), strict=True):
        piece = model(**piece_inputs, use_cache=False).logits
        total = nn.functional.cross_entropy(
            piece[:, :-1].reshape(-1, piece.shape[-1]),
            part[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (total / count).backward()
        summed += (total / count).item()
        parts.append(piece.detach())
    grads = _grads(model)
    # Logits in float32 (a head that computes in float32): the loss's sum and mean round
    # at float32's precision.
    rounding = torch.finfo(logits.dtype).eps * abs(loss) if logits.dtype != torch.float64 else 0
    return {
        "loss": max(abs(summed - loss), rounding),
        "logits": (torch.cat(parts) - logits).abs().max().item(),
        **{n: (grads[n] - whole[n]).abs().max().item() for n in whole if n in grads},
    }
