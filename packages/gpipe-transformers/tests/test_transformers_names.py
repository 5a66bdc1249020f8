"""A pipelined causal LM's parameters, buffers and state dict have the model's own names,
in one process and across ranks; the model object is the one trained; ties are kept."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd

from gpipe_transformers import pipeline
from hf_support.models import FAMILIES, batch, model
from hf_support.ranks import run


@pytest.mark.parametrize("family", FAMILIES)
def test_names_are_the_models(family: str) -> None:
    built = model(family)
    pipe = pipeline(built, balance=[1, 3], chunks=2)
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in built.named_parameters()]
    assert [n for n, _ in pipe.named_buffers()] == [n for n, _ in built.named_buffers()]
    assert list(pipe.state_dict()) == list(built.state_dict())
    for name, parameter in built.named_parameters():
        assert pipe.get_parameter(name) is parameter
    tied = built.config.tie_word_embeddings
    head = pipe.get_parameter("lm_head.weight")
    embedding = built.get_input_embeddings().weight
    assert (head is embedding) == tied


def test_load_state_dict_takes_the_models_and_reports_its_names() -> None:
    built = model("llama")
    other = model("llama", seed=1)
    pipe = pipeline(built, balance=[2, 2])
    result = pipe.load_state_dict(other.state_dict(), strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert all(
        torch.equal(a, b) for a, b in zip(built.parameters(), other.parameters(), strict=True)
    )
    state = other.state_dict()
    del state["model.norm.weight"]
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    result = pipe.load_state_dict(state, strict=False)
    assert result.missing_keys == ["model.norm.weight"]
    assert result.unexpected_keys == ["model.layers.9.mlp.up_proj.weight"]


def test_the_model_object_is_the_one_trained() -> None:
    built = model("gpt2")
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    decay = [p for n, p in pipe.named_parameters() if not (n.endswith("bias") or ".ln_" in n)]
    rest = [p for n, p in pipe.named_parameters() if n.endswith("bias") or ".ln_" in n]
    assert decay and rest
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.1
    )
    before = copy.deepcopy(built.state_dict())
    pipe.step(**batch(0))
    norm = pipe.clip_grad_norm_(1.0)
    assert norm > 0
    optimizer.step()
    changed = [k for k, v in built.state_dict().items() if not torch.equal(v, before[k])]
    assert "transformer.h.0.attn.c_attn.weight" in changed and "lm_head.weight" in changed


def test_distributed_checkpoint_saves_and_loads_under_the_models_names(tmp_path) -> None:
    built = model("qwen2")
    pipe = pipeline(built, balance=[2, 2])
    dcp.save(pipe.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    other = pipeline(model("qwen2", seed=5), balance=[3, 1])
    state = other.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    other.load_state_dict(state)
    assert all(
        torch.equal(a, b) for a, b in zip(pipe.parameters(), other.parameters(), strict=True)
    )


def test_distributed_checkpoints_state_dict_helpers_see_the_models_names() -> None:
    built = model("llama")
    pipe = pipeline(built, balance=[2, 2])
    optimizer = torch.optim.Adam(pipe.parameters())
    pipe.step(**batch(1))
    optimizer.step()
    persistent = [key for key in built.state_dict() if "inv_freq" not in key]
    assert list(dsd.get_model_state_dict(pipe)) == persistent
    state = dsd.get_optimizer_state_dict(pipe, optimizer)["state"]
    assert list(state) == [name for name, _ in built.named_parameters()]


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_each_rank_holds_and_names_only_its_layers(family: str) -> None:
    results = run("names", family=family)
    built = model(family)
    keys = list(built.state_dict())
    union = {key for found in results for key in found["state_dict"]}
    assert union == set(keys)
    for found in results:
        assert found["loaded"] == ([], [])  # the whole model's state dict loads strictly
        assert found["numel"] < found["total"]
        assert set(found["parameters"]) <= {n for n, _ in built.named_parameters()}
        # The model object keeps only this rank's tensors (and a tied copy).
        assert set(found["held"]) < {n for n, _ in built.named_parameters(remove_duplicate=False)}
    first, last = results
    assert "model.layers.0.self_attn.q_proj.weight" in first["state_dict"]
    assert "model.layers.0.self_attn.q_proj.weight" not in last["state_dict"]
    assert "model.norm.weight" in last["state_dict"]
    tied = built.config.tie_word_embeddings
    assert ("lm_head.weight" in first["held"]) == tied
    assert last["drift"] == ({"model.embed_tokens.weight": 0.0} if tied else {})


def _on_meta(family: str) -> torch.nn.Module:
    """A tiny ``family`` model built on the meta device (no memory)."""
    import transformers

    from hf_support.models import config

    made = config(family)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(made, dtype=torch.float64)
    built.train()
    return built


def _buffers(built: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
    """An ``init`` step that computes the non-persistent buffers (rotary ``inv_freq``) of a
    layer made from meta, by the model's own weight initialisation (which also draws the
    weights of those modules: before the state dict)."""

    def init(layer: torch.nn.Module) -> None:
        for module in layer.modules():
            if module._non_persistent_buffers_set:
                built._init_weights(module)  # type: ignore[operator]

    return init


@pytest.mark.parametrize("keys", ["model", "sequence"])
def test_init_takes_the_models_own_state_dict(keys: str) -> None:
    from gpipe_transformers import sequence

    built = model("gemma")
    state = built.state_dict() if keys == "model" else sequence(built).state_dict()
    meta = _on_meta("gemma")
    pipe = pipeline(meta, balance=[2, 2], chunks=2, init=[_buffers(meta), state])
    mine = pipe.state_dict()
    for key, value in built.state_dict().items():
        assert torch.equal(mine[key], value), key
    for name, buffer in built.named_buffers():
        assert torch.equal(pipe.get_buffer(name), buffer), name


def test_init_keys_of_no_tensor_of_the_model_are_refused_by_its_names() -> None:
    meta = _on_meta("llama")
    state = {"model.layers.9.mlp.up_proj.weight": torch.zeros(1), "lm_head.bias": torch.zeros(1)}
    needle = r"keys of no tensor of the model .*'model\.layers\.9\.mlp\.up_proj\.weight'"
    with pytest.raises(ValueError, match=needle) as info:
        pipeline(meta, balance=[2, 2], init=[state])
    assert "'embed'" not in str(info.value) and "layer0" not in str(info.value)


def test_an_uninitialised_buffer_is_named_by_the_models_name() -> None:
    meta = _on_meta("llama")
    with pytest.raises(ValueError, match=r"model\.rotary_emb\.inv_freq, a non-persistent") as info:
        pipeline(meta, balance=[2, 2], init=model("llama").state_dict())
    assert "embed.rotary_emb" not in str(info.value)


def test_tie_word_embeddings_that_differs_across_ranks_is_named_as_the_config_names_it() -> None:
    messages = run("tie_differs")
    for message in messages:
        assert "config.tie_word_embeddings differs across ranks" in message, message
        assert "embed.embed_tokens" not in message and "head.lm_head" not in message, message
