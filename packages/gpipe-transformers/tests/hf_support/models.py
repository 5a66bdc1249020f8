"""Tiny causal LMs of each family, built from configurations (nothing is downloaded), and
the float64 reference they are compared with."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

VOCAB = 40
#: The families the tests name, and whether each ties its embeddings by default.
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gpt2")


def config(
    family: str, *, layers: int = 4, attn: str = "sdpa", dropout: float = 0.0, **extra: Any
) -> Any:
    """The configuration of a tiny ``family`` model with ``layers`` decoder layers."""
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, "num_hidden_layers": layers, "pad_token_id": 0}
    if family == "gpt2":
        made = transformers.GPT2Config(
            n_embd=16, n_head=2, n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
            attn_pdrop=dropout, bos_token_id=1, eos_token_id=2, **common, **extra,
        )  # fmt: skip
    else:
        classes = {
            "llama": transformers.LlamaConfig,
            "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config,
            "gemma": transformers.GemmaConfig,
            "gemma2": transformers.Gemma2Config,
        }
        made = classes[family](
            hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, max_position_embeddings=64, attention_dropout=dropout, **common,
            **extra,
        )  # fmt: skip
    made._attn_implementation = attn
    return made


def any_config(model_type: str, *, layers: int = 4, **extra: Any) -> Any:
    """A tiny configuration of any family, by its model type, with the usual fields set
    small (those a family does not have are ignored by it)."""
    import transformers

    small: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
    }  # fmt: skip
    small.update(extra)
    return transformers.AutoConfig.for_model(model_type, **small)


#: Each family's tiny mixture of experts: 4 experts, 2 per token; DeepSeek-V3's first
#: layer dense (``first_k_dense_replace=1``), with a shared expert.
EXPERTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
    "deepseek_v3": {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_intermediate_size": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 8,
        "v_head_dim": 4, "num_key_value_heads": 2,
    },
}  # fmt: skip


def experts_model(family: str, seed: int = 0, **extra: Any) -> nn.Module:
    """A tiny ``family`` mixture of experts of 4 layers in float64, its weights drawn from
    ``seed`` (eager experts: torch's grouped matrix product takes no float64), with the
    configuration's ``extra`` fields."""
    import transformers

    torch.manual_seed(seed)
    built = transformers.AutoModelForCausalLM.from_config(
        any_config(family, **EXPERTS[family], **extra),
        dtype=torch.float64,
        experts_implementation="eager",
    )
    built.train()
    return built


def model(
    family: str, seed: int = 0, *, dtype: torch.dtype = torch.float64, **options: Any
) -> nn.Module:
    """A tiny ``family`` causal LM in ``dtype``, its weights drawn from ``seed``."""
    import transformers

    made = config(family, **options)
    torch.manual_seed(seed)
    built = transformers.AutoModelForCausalLM.from_config(
        made, attn_implementation=made._attn_implementation, dtype=dtype
    )
    built.train()
    return built


def batch(seed: int, size: int = 6, length: int = 10, *, pad: bool = True) -> dict[str, Tensor]:
    """``input_ids``, a padding ``attention_mask`` (right padding on some samples) and
    ``labels`` (-100 where padded)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.long)
    if pad:
        for row in range(0, size, 2):
            keep = int(torch.randint(2, length + 1, (1,), generator=generator))
            mask[row, keep:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The causal LM's loss in the logits' dtype: the mean next-token cross entropy over
    the labels that are not -100 (transformers computes it in float32)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def reference(built: nn.Module, data: dict[str, Tensor]) -> tuple[nn.Module, Tensor, Tensor]:
    """A copy of ``built`` after one backward of its float64 loss on ``data``: the copy,
    the loss and the logits."""
    plain = copy.deepcopy(built)
    logits = plain(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    loss = reference_loss(logits, data["labels"])
    loss.backward()
    return plain, loss.detach(), logits.detach()


def router_reference(built: nn.Module, data: dict[str, Tensor]) -> tuple[nn.Module, Tensor, Tensor]:
    """A copy of ``built`` after one backward of its loss with the router loss
    (``output_router_logits=True``) on ``data``: the float64 labels loss plus the model's
    coefficient times its own ``aux_loss`` (whose statistics transformers computes in
    float32). The copy, the loss and the ``aux_loss``."""
    plain = copy.deepcopy(built)
    out = plain(
        input_ids=data["input_ids"],
        attention_mask=data["attention_mask"],
        output_router_logits=True,
    )
    coefficient = getattr(plain, "router_aux_loss_coef", None) or plain.config.router_aux_loss_coef
    loss = reference_loss(out.logits, data["labels"]) + coefficient * out.aux_loss.double()
    loss.backward()
    return plain, loss.detach(), out.aux_loss.detach().double()


#: Families whose norms compute in float32 even in a float64 model (``x.float()``).
FLOAT32_NORMS = {"gemma", "gemma2", "gemma3_text", "cohere", "cohere2"}


def float32_inside(family: str, name: str) -> bool:
    """Whether ``family`` computes the gradient of parameter ``name`` in float32 even in a
    float64 model: Gemma's and Cohere's norms upcast to float32 (``x.float()``), so their
    weights' gradients summed over micro-batches differ from the whole batch's at
    float32's precision, in the model's own code."""
    return family in FLOAT32_NORMS and "norm" in name


def largest_grad_difference(
    pipelined: nn.Module, plain: nn.Module, family: str = "", relative_float32: float = 1e-6
) -> float:
    """The largest difference between the gradients of two models' parameters of the same
    name (those with a gradient on the first: across ranks, its own). A parameter whose
    gradient ``family`` computes in float32 (:func:`float32_inside`) is checked here
    against ``relative_float32`` of its size instead, and left out of the result."""
    theirs = dict(plain.named_parameters())
    largest = 0.0
    for name, parameter in pipelined.named_parameters():
        if parameter.grad is None or parameter.device.type == "meta":
            continue
        other = theirs[name].grad
        assert other is not None, name
        difference = (parameter.grad - other).abs().max().item()
        if float32_inside(family, name):
            scale = other.abs().max().item()
            assert difference <= relative_float32 * scale, (name, difference, scale)
            continue
        largest = max(largest, difference)
    return largest
