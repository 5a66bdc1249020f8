"""Families the package names nowhere work the same: what each does around its decoder
layers (embedding multipliers, logit scaling, soft-capping, per-layer sliding windows,
other module names) runs as its own code. Models whose layout cannot be found, or that a
pipeline cannot train to their own numbers, are refused with an error naming why."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpipe_transformers import LayoutError, pipeline
from hf_support.models import (
    any_config,
    batch,
    largest_grad_difference,
    model,
    reference,
)

TOLERANCE = 1e-10


def _built(model_type: str, **extra: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = any_config(model_type, **extra)
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.float64
        )
    except ValueError:  # a family without sdpa
        return AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float64
        )


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        (
            "granite",
            {"embedding_multiplier": 3.0, "logits_scaling": 5.0, "residual_multiplier": 0.5},
        ),
        ("cohere", {"logit_scale": 0.3}),
        # eager only: with a sliding window, a padded row sees no key (NaN in the model
        # itself), so its batch is not padded.
        ("gemma2", {"final_logit_softcapping": 2.0, "sliding_window": 4}),
        ("gemma3_text", {"sliding_window": 4}),
        ("qwen3", {}),
        ("phi3", {}),
        ("olmo2", {}),
        ("starcoder2", {}),
        ("gpt_neox", {}),  # other names: embed_in, final_layer_norm, embed_out
    ],
)
def test_a_family_not_named_trains_to_its_own_numbers(model_type: str, extra: dict) -> None:
    built = _built(model_type, **extra)
    data = batch(5, size=4, length=9, pad=model_type != "gemma2")
    plain, loss, logits = reference(built, data)
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    losses = pipe.step(**data, schedule="1f1b")
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain, model_type) < TOLERANCE
    out = pipe(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
    assert (out - logits).abs().max().item() < TOLERANCE
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in built.named_parameters()]


def test_a_family_whose_scaling_were_lost_would_be_seen() -> None:
    # The test above can fail: Granite's logits_scaling changes the logits, so a head that
    # skipped the causal LM's own forward would differ.
    plain = _built("granite", logits_scaling=5.0)
    scaled = plain(input_ids=torch.tensor([[3, 4, 5]])).logits
    unscaled = plain.lm_head(plain.model(input_ids=torch.tensor([[3, 4, 5]])).last_hidden_state)
    assert (scaled - unscaled).abs().max() > 1e-3


@pytest.mark.parametrize(
    "model_type",
    # Without a pipeline plan: OPT, Falcon, GPT-Neo; Bloom's ALiBi biases; the decoder
    # inside BART's wrapper; BERT's causal head (layers in bert.encoder.layer); the text
    # model inside Gemma 3's multimodal wrapper; Llama 4's text model; Mamba's state-space
    # layers; HunYuan-V4's layers, which hand the next one a pair (hidden states, top-k
    # indices); Gemma 4's head, which reads the inputs' length; DeepSeek-V4's hc_head
    # between the last layer and the norm; X-MOD's layers, given the language's ids.
    [
        "opt",
        "falcon",
        "gpt_neo",
        "bloom",
        "bart",
        "bert",
        "gemma3",
        "llama4_text",
        "mamba",
        "hy_v4",
        "gemma4_text",
        "deepseek_v4",
        "xmod",
    ],
)
def test_a_family_without_a_plan_trains_to_its_own_numbers(model_type: str) -> None:
    from hf_support.sweep import outcome

    result = outcome(model_type)
    assert result.kind == "exact", result.detail


def _refusal(model_type: str) -> str:
    from hf_support.sweep import build

    built = build(model_type)
    before = copy.deepcopy(built.state_dict())
    with pytest.raises(LayoutError) as info:
        pipeline(built, balance=[2, 2], chunks=2)
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())
    assert built.training and all(m.training for m in built.modules())
    message = str(info.value)
    assert "write the model as an nn.Sequential" in message, message
    return message


def test_a_family_whose_base_model_computes_more_after_its_layers_is_refused_by_name() -> None:
    # CPM-Ant's base model drops its prompt's positions after the layers.
    message = _refusal("cpmant")
    assert message.startswith("CpmAntForCausalLM's forward does not run as a sequence")
    assert "it computes more than their calls" in message


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    skipped=st.sets(st.integers(0, 3), max_size=4),
    balance=st.sampled_from([(2, 2), (1, 3), (3, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)]),
)
def test_layers_the_family_passes_over_are_passed_over(
    skipped: set[int], balance: tuple[int, ...]
) -> None:
    # Mllama's forward passes over its cross-attention layers without images (any of them:
    # first, last, in the middle, at a partition's edge, a whole partition's); one that
    # passes over every layer is refused before anything runs.
    from hf_support.sweep import outcome

    result = outcome("mllama", balance, cross_attention_layers=sorted(skipped))
    if len(skipped) == 4:
        assert result.kind == "refused", result
        assert "it called none of its 4 layers" in result.detail, result.detail
    else:
        assert result.kind == "exact", result.detail


def test_two_layers_passed_over_are_exact_and_all_of_them_refused() -> None:
    # The examples above are drawn at random; these two always run.
    from hf_support.sweep import outcome

    assert outcome("mllama", (2, 2), cross_attention_layers=[1, 2]).kind == "exact"
    assert outcome("mllama", (2, 2), cross_attention_layers=[0, 1, 2, 3]).kind == "refused"


def test_a_family_that_calls_its_layers_out_of_order_is_refused_by_name() -> None:
    # Dory's forward runs its layers in a loop, more than once each.
    message = _refusal("dory")
    assert "not each at most once in order" in message, message


def test_a_module_after_the_layers_that_also_runs_between_them_is_refused() -> None:
    # The embeddings end a forward that passes over its last layers at the first module
    # after them: one that also runs between the layers (here the norm, on a side value
    # after layer 0) would end it early and pass over the rest, so it is refused.
    from transformers import LlamaForCausalLM, LlamaModel
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class SideNorm(LlamaModel):
        def forward(self, input_ids: torch.Tensor, **kwargs: object) -> BaseModelOutputWithPast:
            hidden = self.embed_tokens(input_ids)
            positions = torch.arange(hidden.shape[1])[None]
            rotary = self.rotary_emb(hidden, positions)
            for index, layer in enumerate(self.layers):
                hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
                if index == 0:
                    self.norm(hidden)  # a side value, not the hidden states' way
            return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))

    class SideNormForCausalLM(LlamaForCausalLM):
        def __init__(self, config: object) -> None:
            super().__init__(config)
            self.model = SideNorm(config)

    torch.manual_seed(0)
    built = SideNormForCausalLM(any_config("llama", attn_implementation="sdpa"))
    with pytest.raises(LayoutError) as info:
        pipeline(built, balance=[2, 2], chunks=2)
    assert "its modules after the last layer (model.norm) also run between its layers" in str(
        info.value
    )


def test_a_model_without_one_list_of_layers_is_refused_saying_what_was_looked_for() -> None:
    # XLM keeps its layers' parts in four parallel lists.
    message = _refusal("xlm")
    assert "no single ModuleList of XLMWithLMHeadModel's decoder layers" in message
    assert "num_hidden_layers (4)" in message and "transformer.attentions (4)" in message


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_encoder_decoder_models_are_refused() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=40, d_model=8, d_ff=16, num_layers=1, num_heads=2, d_kv=4)
    )
    with pytest.raises(LayoutError, match=r"^encoder-decoder models are not supported"):
        pipeline(t5)


def test_a_base_model_without_its_head_is_refused_naming_the_causal_lm() -> None:
    base = model("llama").model
    with pytest.raises(LayoutError, match=r"pass a causal LM such as LlamaForCausalLM"):
        pipeline(base)


def test_not_a_hugging_face_model_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^model must be a Hugging Face causal language model"):
        pipeline(torch.nn.Linear(2, 2))


def test_a_mixture_of_experts_trains_to_its_router_loss() -> None:
    # Qwen2-MoE (shared experts beside the routed ones) with its router loss: the model's
    # loss and gradients (transformers sums the router statistics in float32).
    from hf_support.models import largest_grad_difference, router_reference

    built = _built(
        "qwen2_moe", output_router_logits=True, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, shared_expert_intermediate_size=8, router_aux_loss_coef=0.5,
        experts_implementation="eager",
    )  # fmt: skip
    built.train()
    data = batch(4, size=8)
    plain, loss, _ = router_reference(built, data)
    losses = pipeline(built, balance=[1, 3], chunks=4).step(**data)
    assert abs(losses.reduced().item() - loss.item()) <= 1e-6
    assert largest_grad_difference(built, plain) <= 1e-6


@pytest.mark.parametrize(
    ("keywords", "error", "needle"),
    [
        ({"use_cache": True}, ValueError, "use_cache is not supported"),
        ({"output_attentions": True}, ValueError, "output_attentions is not supported"),
        ({"output_hidden_states": True}, ValueError, "output_hidden_states is not supported"),
        ({"past_key_values": object()}, ValueError, "past_key_values is not supported"),
    ],
)
def test_what_a_pipeline_does_not_return_is_refused_before_it_runs(
    keywords: dict, error: type, needle: str
) -> None:
    built = model("llama")
    before = copy.deepcopy(built.state_dict())
    pipe = pipeline(built, balance=[2, 2])
    data = batch(0)
    with pytest.raises(error, match=needle):
        pipe.step(**data, **keywords)
    with pytest.raises(error, match=needle):
        pipe(input_ids=data["input_ids"], **keywords)
    assert all(p.grad is None for p in built.parameters())
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())
    assert pipe.step(**data).reduced().isfinite()  # still usable


def test_labels_given_to_forward_are_refused_naming_step() -> None:
    pipe = pipeline(model("llama"), balance=[2, 2])
    data = batch(0)
    with pytest.raises(TypeError, match=r"pass labels to step\(\)"):
        pipe(**data)


@pytest.mark.parametrize(
    ("balance", "error", "needle"),
    [
        ([1, 1], ValueError, "must sum to the model's 4 decoder layers (balance: [1, 1], sum: 2"),
        ("2,2", TypeError, "balance must be a sequence of ints (balance: '2,2')"),
        ([2, -2, 4], ValueError, "balance must hold non-negative ints (balance: [2, -2, 4])"),
        ([2, 0, 2], ValueError, "every partition but the first and the last a decoder layer"),
    ],
)
def test_a_wrong_balance_is_refused(balance: object, error: type, needle: str) -> None:
    with pytest.raises(error, match=re_escape(needle)):
        pipeline(model("llama"), balance=balance)  # type: ignore[arg-type]


def test_a_balance_of_the_whole_sequence_from_balance_by_time() -> None:
    from gpipe_balance import balance_by_time
    from gpipe_transformers import sequence

    built = model("llama")
    data = batch(0)
    sample = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    balance = balance_by_time(2, sequence(built), sample, timeout=0)
    assert sum(balance) == 4 + 2
    plain, loss, _ = reference(built, data)
    pipe = pipeline(built, balance=balance, chunks=2)
    assert pipe.balance == balance
    losses = pipe.step(**data)
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(built, plain) < TOLERANCE


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda pipe, data: pipe.step(input_ids=data["input_ids"]), TypeError, "step needs labels"),
        (
            lambda pipe, data: pipe.step(data),
            TypeError,
            r"pass a batch dict as pipe\.step\(\*\*batch\)",
        ),
        (lambda pipe, data: pipe(data), TypeError, r"pass a batch dict as pipe\(\*\*batch\)"),
        (
            lambda pipe, data: pipe.step(**data, schedule="zbv"),
            ValueError,
            'build the pipeline with placement="v"',
        ),
        (
            lambda pipe, data: pipe.step(
                input_ids=data["input_ids"],
                target=data["labels"],
                loss_fn=torch.nn.functional.cross_entropy,
            ),
            RuntimeError,
            r"takes the logits flattened to \(tokens, vocabulary\)",
        ),
    ],
    ids=["no-labels", "step-dict", "forward-dict", "zbv", "loss-shape"],
)
def test_a_mistake_gets_an_error_that_says_what_to_do(call, error: type, needle: str) -> None:
    built = model("llama")
    before = copy.deepcopy(built.state_dict())
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    data = batch(0)
    with pytest.raises(error, match=needle):
        call(pipe, data)
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())
    assert pipe.step(**data).reduced().isfinite()  # still usable


def test_a_model_on_the_meta_device_points_to_from_pretrained_by_the_models_names() -> None:
    from transformers import AutoModelForCausalLM

    from hf_support.models import config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config("llama"))
    with pytest.raises(ValueError, match=r"on the meta device") as info:
        pipeline(meta, balance=[2, 2])
    message = str(info.value)
    assert "gpipe.transformers.from_pretrained" in message
    assert "model.embed_tokens.weight" in message and "layer0" not in message


def test_a_family_whose_hidden_states_carry_the_batch_elsewhere_is_refused_by_name() -> None:
    # Gemma 3n stacks its streams in front of the batch: (streams, batch, length, width).
    message = _refusal("gemma3n_text")
    assert "do not carry the probe's 2 samples in their first dimension" in message
