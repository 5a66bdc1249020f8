"""Generation through a pipeline (``pipe.generate``): token for token the model's own
``generate``, greedy, for every family the tests name (tied embeddings, a mixture of
experts, sliding windows), left-padded prompts of different lengths, sequences reaching an
end token at different steps, any ``chunks`` and balance; sampling under a seed; the
refusals; training after generating.

Compared in float64 with sdpa (transformers' eager attention gives NaN on left-padded
prompts in float64, in the plain model too).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gpipe_transformers import pipeline
from hf_support.cases import prompts
from hf_support.models import any_config, model, reference_loss

NEW = 16


def end_token(built: nn.Module, data: dict[str, Tensor]) -> int:
    """A token the model's greedy generation reaches mid-way in some sequences but not all:
    the one most often generated at step 3."""
    with torch.no_grad():
        free = built.generate(**data, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    new = free[:, data["input_ids"].shape[1] :]
    values, counts = new[:, 3].unique(return_counts=True)
    return int(values[counts.argmax()])


def moe(seed: int = 0) -> nn.Module:
    import transformers

    made = any_config("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    made._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    # Eager experts: torch's grouped matrix product takes no float64.
    return transformers.AutoModelForCausalLM.from_config(
        made, dtype=torch.float64, experts_implementation="eager"
    )


def built_model(family: str, seed: int = 0) -> nn.Module:
    if family == "mixtral":
        return moe(seed).eval()
    if family == "mistral-window":
        return model("mistral", seed, sliding_window=3).eval()
    return model(family, seed).eval()


FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gpt2", "mixtral")


@pytest.mark.parametrize("family", [*FAMILIES, "mistral-window"])
@pytest.mark.parametrize(("chunks", "balance"), [(1, [1, 3]), (2, [3, 1]), (4, [2, 2])])
def test_greedy_generation_is_the_models(family: str, chunks: int, balance: list[int]) -> None:
    built = built_model(family)
    data = prompts(seed=len(family) + chunks)
    eos = end_token(built, data)
    options: dict[str, Any] = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": eos}
    with torch.no_grad():
        expected = built.generate(**data, **options)
    pipe = pipeline(built, balance=balance, chunks=chunks)
    found = pipe.generate(**data, **options)
    assert torch.equal(found, expected), (found, expected)
    # The end token stopped some sequences mid-way, and not all at once.
    new = expected[:, data["input_ids"].shape[1] :]
    assert (new == eos).any(dim=1).any() and expected.shape[1] > data["input_ids"].shape[1] + 4


def test_three_partitions_and_several_end_tokens() -> None:
    built = built_model("llama", seed=3)
    data = prompts(seed=5, size=6)
    options = {
        "max_new_tokens": NEW, "do_sample": False, "eos_token_id": [end_token(built, data), 7],
        "repetition_penalty": 1.3,
    }  # fmt: skip
    with torch.no_grad():
        expected = built.generate(**data, **options)
    pipe = pipeline(built, balance=[1, 2, 1], devices=["cpu"] * 3, chunks=3)
    assert torch.equal(pipe.generate(**data, **options), expected)


def test_sampling_with_one_lane_draws_the_models_tokens() -> None:
    built = built_model("qwen2", seed=1)
    data = prompts(seed=2)
    options = {"max_new_tokens": NEW, "do_sample": True, "top_k": 10, "temperature": 0.8}
    torch.manual_seed(123)
    with torch.no_grad():
        expected = built.generate(**data, **options)
    pipe = pipeline(built, balance=[2, 2], chunks=1)
    torch.manual_seed(123)
    found = pipe.generate(**data, **options)
    assert torch.equal(found, expected)
    torch.manual_seed(124)
    assert not torch.equal(pipe.generate(**data, **options), expected)  # a seed's draws


class Recorder:
    """A logits processor that keeps the scores it is given, by the sequences so far."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        for row, score in zip(ids.tolist(), scores, strict=True):
            self.seen[tuple(row)] = score.clone()
        return scores


def test_sampling_with_lanes_draws_from_the_models_distribution() -> None:
    from transformers import LogitsProcessorList

    built = built_model("llama", seed=4)
    data = prompts(seed=9, size=4)
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    recorder = Recorder()
    torch.manual_seed(0)
    found = pipe.generate(
        **data, max_new_tokens=6, do_sample=True, temperature=0.7,
        logits_processor=LogitsProcessorList([recorder]),
    )  # fmt: skip
    # Each step's processed scores are the model's for the sequence so far.
    length = data["input_ids"].shape[1]
    for step in range(6):
        ids = found[:, : length + step]
        mask = torch.cat([data["attention_mask"], torch.ones(4, step, dtype=torch.long)], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = built(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for row in range(4):
            seen = recorder.seen[tuple(ids[row].tolist())]
            torch.testing.assert_close(seen, logits[row, -1].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_beams": 2}, r"greedily or by sampling.*beam_search \(num_beams: 2"),
        (
            {"return_dict_in_generate": True, "output_scores": True},
            "return_dict_in_generate is not",
        ),
        ({"use_cache": False}, r"use_cache=False is not supported"),
        ({"assistant_model": object()}, "assistant_model is not supported"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive_search"),
    ],
)
def test_unsupported_options_are_refused_before_anything_runs(
    options: dict[str, Any], message: str
) -> None:
    built = built_model("llama")
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    calls: list[int] = []
    pipe.partitions[0].register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        pipe.generate(**prompts(0), max_new_tokens=4, **options)
    assert not calls


def test_a_family_whose_cache_is_not_attentions_is_refused() -> None:
    import transformers

    # Qwen3.5's text model has linear-attention layers beside full attention ones.
    made = any_config("qwen3_5_text", layers=4)
    built = transformers.AutoModelForCausalLM.from_config(made, dtype=torch.float64)
    pipe = pipeline(built, balance=[2, 2])
    with pytest.raises(
        ValueError, match=r"generate supports the caches of attention layers"
    ) as info:
        pipe.generate(input_ids=torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)
    assert "LinearAttentionLayer" in str(info.value)


def test_training_after_generating_gives_the_models_loss() -> None:
    built = model("gemma", seed=2)  # tied embeddings
    plain = copy.deepcopy(built)
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    data = prompts(seed=3)
    pipe.eval()
    pipe.generate(**data, max_new_tokens=4, do_sample=False)
    pipe.train()
    plain.train()
    labels = data["input_ids"].masked_fill(data["attention_mask"] == 0, -100)
    losses = pipe.step(**data, labels=labels)
    logits = plain(**data).logits
    expected = reference_loss(logits, labels)
    torch.testing.assert_close(losses.reduced(), expected, rtol=1e-12, atol=1e-12)
    # And generates again, from empty caches.
    pipe.eval()
    plain.load_state_dict(built.state_dict())
    plain.eval()
    with torch.no_grad():
        expected_tokens = plain.generate(**data, max_new_tokens=5, do_sample=False)
    assert torch.equal(pipe.generate(**data, max_new_tokens=5, do_sample=False), expected_tokens)


# -- across ranks ----------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "chunks"), [("gemma", 2), ("llama", 1), ("qwen2", 4)])
def test_two_ranks_generate_the_models_tokens(family: str, chunks: int) -> None:
    from hf_support.ranks import run

    torch.set_default_dtype(torch.float64)
    try:
        built = model(family).eval()
        data = prompts(0)
        options = {
            "max_new_tokens": NEW,
            "do_sample": False,
            "eos_token_id": end_token(built, data),
        }
        with torch.no_grad():
            expected = built.generate(**data, **options)
    finally:
        torch.set_default_dtype(torch.float32)
    results = run("generated", family=family, chunks=chunks, options=options)
    for rank, found in enumerate(results):
        assert torch.equal(torch.tensor(found["tokens"]), expected), rank
        assert found["loss"] < 1e-10, (rank, found["loss"])


def test_a_rank_killed_mid_generation_fails_every_rank() -> None:
    from hf_support.ranks import replies

    found = replies("generate_dies", dying_rank=1, timeout=120)
    assert not found[1][0], found[1]  # gone
    ok, result = found[0]
    assert ok, result
    assert result["type"] == "RemotePartitionError", result
    assert "rank 1" in result["message"] and "died" in result["message"], result


def test_ranks_that_disagree_on_the_options_are_refused_alike() -> None:
    from hf_support.ranks import run

    results = run("generate_disagrees")
    for found in results:
        assert found["error"]["type"] == "RanksDisagree", found
        assert "generation options" in found["error"]["message"], found
    assert results[0]["tokens"] == results[1]["tokens"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_generation_on_a_gpu_is_the_models() -> None:
    built = model("llama").eval().to("cuda")  # float64, as on the CPU
    data = {key: value.to("cuda") for key, value in prompts(seed=1).items()}
    options = {"max_new_tokens": NEW, "do_sample": False}
    with torch.no_grad():
        expected = built.generate(**data, **options)
    pipe = pipeline(built, balance=[2, 2], chunks=2, devices=["cuda:0", "cuda:0"])
    assert torch.equal(pipe.generate(**data, **options), expected)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        # Sliding-window and full attention layers mixed: two caches' kinds in one model.
        (
            "gemma3_text",
            {
                "sliding_window": 3,
                "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            },
        ),
        ("olmo3", {"sliding_window": 3}),
        ("starcoder2", {"sliding_window": 3}),
        ("phi3", {}),
        ("cohere", {}),
    ],
)
def test_families_the_code_does_not_name_generate_the_models_tokens(
    model_type: str, extra: dict[str, Any]
) -> None:
    import transformers

    made = any_config(model_type, **extra)
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(
        made, dtype=torch.float64, attn_implementation="sdpa"
    )
    assert_generates_as_the_model(built.eval(), [1, 3], 2)


def assert_generates_as_the_model(built: nn.Module, balance: list[int], chunks: int) -> None:
    """Ten tokens greedily from three left-padded prompts, through a pipeline of ``built``
    over ``balance`` at ``chunks``: the model's own."""
    data = prompts(3)
    options = {"max_new_tokens": 10, "do_sample": False}
    with torch.no_grad():
        expected = built.generate(**data, **options)
    pipe = pipeline(built, balance=balance, chunks=chunks)
    assert torch.equal(pipe.generate(**data, **options), expected)


@pytest.mark.parametrize(("balance", "chunks"), [([1, 3], 2), ([2, 2], 1), ([3, 1], 3)])
def test_a_family_that_passes_over_layers_generates_the_models_tokens(
    balance: list[int], chunks: int
) -> None:
    # Mllama's text model passes over its cross-attention layer (1) without images: its
    # cache holds no positions for it, the pipeline's neither.
    import transformers

    from hf_support.sweep import tiny_config

    made = tiny_config("mllama")
    made.cross_attention_layers = [1]
    torch.manual_seed(0)
    built = transformers.MllamaForCausalLM._from_config(
        made, dtype=torch.float64, attn_implementation="sdpa"
    )
    assert_generates_as_the_model(built.eval(), balance, chunks)


def test_three_ranks_generate_the_models_tokens() -> None:
    # Each lane's next input goes from the last rank to the first past the middle one.
    from hf_support.ranks import close, run

    torch.set_default_dtype(torch.float64)
    try:
        built = model("llama").eval()
        data = prompts(0)
        options = {"max_new_tokens": 8, "do_sample": False}
        with torch.no_grad():
            expected = built.generate(**data, **options)
    finally:
        torch.set_default_dtype(torch.float32)
    try:
        results = run("generated", world=3, family="llama", chunks=3, options=options)
    finally:
        close(3)  # three ranks are not kept for the other tests
    for rank, found in enumerate(results):
        assert torch.equal(torch.tensor(found["tokens"]), expected), rank
        assert found["loss"] < 1e-10, (rank, found["loss"])
