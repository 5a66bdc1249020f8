"""``from_pretrained`` reads only this rank's tensors of a Hugging Face checkpoint and
trains to the numbers of the model transformers loads; ``save_pretrained`` writes a
directory transformers loads with the trained weights, in one process and across ranks;
what is missing from a checkpoint is refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpipe_transformers import from_pretrained, pipeline
from hf_support.models import batch, model, reference_loss
from hf_support.ranks import run

TOLERANCE = 1e-10


def _loaded(folder: Path, **options: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), **options)
    loaded.train()
    return loaded


def _trained(built: torch.nn.Module, steps: int = 2, lr: float = 0.1) -> torch.nn.Module:
    """``built`` after ``steps`` SGD steps on batches 1, 2, ... without a pipeline."""
    plain = copy.deepcopy(built)
    optimizer = torch.optim.SGD(plain.parameters(), lr=lr)
    for step in range(steps):
        data = batch(step + 1, size=8)
        optimizer.zero_grad(set_to_none=True)
        logits = plain(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
        reference_loss(logits, data["labels"]).backward()
        optimizer.step()
    return plain


def _largest_difference(one: torch.nn.Module, other: torch.nn.Module) -> float:
    theirs = other.state_dict()
    mine = one.state_dict()
    assert set(mine) == set(theirs)
    return max((value - theirs[key]).abs().max().item() for key, value in mine.items())


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_from_pretrained_on_two_ranks_equals_the_loaded_model(
    family: str, sharded: bool, tmp_path: Path
) -> None:
    built = model(family)
    built.save_pretrained(tmp_path, max_shard_size="2KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    results = run("from_pretrained_exact", folder=str(tmp_path), family=family)
    total = sum(p.numel() for p in built.parameters())
    held = set()
    for rank, found in enumerate(results):
        assert found["total"] == total
        assert 0 < found["numel"] < total, (rank, found["numel"], total)
        assert found["dtype"] == "torch.float64"
        assert found["loss"] < TOLERANCE, (rank, found["loss"])
        assert found["grad"] < TOLERANCE, (rank, found["grad"])
        assert found["nan"] == []
        # Each tensor it holds read once, and nothing else.
        assert sorted(found["read"]) == sorted(set(found["read"]))
        assert set(found["read"]) <= set(found["held"]) | {"model.embed_tokens.weight"}
        assert all(d == 0.0 for d in found["buffers"].values()), found["buffers"]
        held.update(found["held"])
    first, last = results
    # The first rank holds the rotary embedding (and Gemma's embedding scale), computed.
    assert "model.rotary_emb.inv_freq" in first["buffers"]
    assert ("model.embed_tokens.embed_scale" in first["buffers"]) == (family == "gemma")
    assert "model.layers.0.self_attn.q_proj.weight" in first["held"]
    assert "model.layers.0.self_attn.q_proj.weight" not in last["held"]
    assert "lm_head.weight" in last["held"]
    assert held >= {n for n, _ in built.named_parameters()}


@pytest.mark.parametrize(
    ("family", "whole"),
    [("llama", False), ("gemma", False), ("gemma", True)],
    ids=["llama-from_pretrained", "gemma-from_pretrained", "gemma-whole-model"],
)
def test_save_pretrained_on_two_ranks_writes_the_trained_model(
    family: str, whole: bool, tmp_path: Path
) -> None:
    built = model(family)
    source, out = tmp_path / "source", tmp_path / "out"
    built.save_pretrained(source)
    keys = run("pretrained_round_trip", source=str(source), out=str(out), whole=whole)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"].values()) == set(shards)
    persistent = [k for k in built.state_dict() if "inv_freq" not in k and "embed_scale" not in k]
    tied = built.config.tie_word_embeddings
    assert set(index["weight_map"]) == {
        k for k in persistent if not (tied and k == "lm_head.weight")
    }
    for shard in shards:  # each rank's own tensors only
        written = load_file(out / shard)
        rank = int(shard[6:11]) - 1
        assert set(written) <= set(keys[rank])
    sizes = sum(t.numel() * t.element_size() for s in shards for t in load_file(out / s).values())
    assert index["metadata"]["total_size"] == sizes
    loaded = _loaded(out)
    assert _largest_difference(loaded, _trained(_loaded(source))) < TOLERANCE
    assert _largest_difference(loaded, built) > 1e-3  # trained


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2"])
def test_save_pretrained_in_one_process_writes_the_trained_model(
    family: str, tmp_path: Path
) -> None:
    built = model(family)
    expected = _trained(built)
    pipe = pipeline(built, balance=[1, 3], chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        pipe.step(**batch(step + 1, size=8))
        optimizer.step()
    pipe.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    written = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in written) == (not built.config.tie_word_embeddings)
    loaded = _loaded(tmp_path)
    assert _largest_difference(loaded, expected) < TOLERANCE
    # And back: from_pretrained reads it into a pipeline of the same weights.
    state = from_pretrained(tmp_path, balance=[2, 2]).state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(state[key], value), key


def test_save_pretrained_with_data_parallel_replicas_writes_once(tmp_path: Path) -> None:
    first, others = run("save_replica", out=str(tmp_path))
    assert others == []
    assert "model.safetensors" in first and "config.json" in first
    assert _largest_difference(_loaded(tmp_path), model("llama")) == 0.0


def test_from_pretrained_in_one_process_equals_the_loaded_model(tmp_path: Path) -> None:
    built = model("gemma")
    built.save_pretrained(tmp_path, max_shard_size="2KB")
    pipe = from_pretrained(tmp_path, balance=[1, 3], chunks=3, attn_implementation="eager")
    loaded = _loaded(tmp_path, attn_implementation="eager")
    data = batch(3, size=6)
    logits = loaded(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    with torch.no_grad():
        out = pipe(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
    assert (out - logits).abs().max().item() < TOLERANCE
    assert pipe.causal_lm.config._attn_implementation == "eager"
    assert pipe.get_parameter("lm_head.weight") is pipe.get_parameter("model.embed_tokens.weight")
    assert torch.equal(pipe.causal_lm.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)


def test_from_pretrained_converts_to_dtype(tmp_path: Path) -> None:
    model("llama").save_pretrained(tmp_path)
    pipe = from_pretrained(tmp_path, dtype=torch.float32, balance=[2, 2])
    assert {p.dtype for p in pipe.parameters()} == {torch.float32}


def test_a_directory_without_a_configuration_is_refused(tmp_path: Path) -> None:
    model("llama").save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json.*" + str(tmp_path)):
        from_pretrained(tmp_path)


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no safetensors checkpoint.*model\.safetensors"):
        from_pretrained(tmp_path)


def test_a_missing_shard_is_refused_by_name(tmp_path: Path) -> None:
    model("llama").save_pretrained(tmp_path, max_shard_size="2KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("key", ["model.norm.weight", "model.layers.1.mlp.up_proj.weight"])
def test_a_missing_key_is_refused_by_name_and_file(key: str, tmp_path: Path) -> None:
    model("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=rf"{key}.*{file}"):
        from_pretrained(tmp_path)


def test_a_checkpoint_of_names_without_the_base_models_prefix_is_read(tmp_path: Path) -> None:
    built = model("gpt2")
    built.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    assert "transformer.h.0.attn.c_attn.weight" in tensors
    bare = {key.removeprefix("transformer."): value for key, value in tensors.items()}
    save_file(bare, file, metadata={"format": "pt"})
    state = from_pretrained(tmp_path, balance=[2, 2]).state_dict()
    for key, value in built.state_dict().items():
        assert torch.equal(state[key], value), key


def test_a_tied_head_absent_from_the_checkpoint_is_read_from_the_embedding(
    tmp_path: Path,
) -> None:
    built = model("gemma")
    built.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    pipe = from_pretrained(tmp_path, balance=[2, 2])
    head = pipe.get_parameter("lm_head.weight")
    assert torch.equal(head, built.lm_head.weight)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_a_model_converted_after_it_was_built_is_read_back_in_its_dtype(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    built = model("llama", dtype=torch.float32).to(dtype)  # its configuration says float32
    pipeline(built, balance=[2, 2]).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["dtype"] == str(dtype).removeprefix("torch.")  # as transformers writes it
    loaded = _loaded(tmp_path)
    assert loaded.dtype == dtype
    pipe = from_pretrained(tmp_path, balance=[2, 2])
    assert {p.dtype for p in pipe.parameters()} == {dtype}
    state = pipe.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(state[key], value), key


def test_from_pretrained_takes_dtype_as_transformers_does(tmp_path: Path) -> None:
    model("llama", dtype=torch.float32).to(torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]  # "auto" then reads the checkpoint's
    (tmp_path / "config.json").write_text(json.dumps(config))
    for dtype in (None, "auto", torch.float64, "float16"):
        options: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
        expected = _loaded(tmp_path, **options).dtype
        pipe = from_pretrained(tmp_path, balance=[2, 2], **options)
        assert {p.dtype for p in pipe.parameters()} == {expected}, dtype
    assert expected == torch.float16
    needle = r"dtype must be 'auto', a torch\.dtype .*\(dtype: 'fp8'\)"
    with pytest.raises(ValueError, match=needle):
        from_pretrained(tmp_path, dtype="fp8")
