"""Mixture-of-experts checkpoints as transformers saves them (one tensor per expert, which it
fuses into the model's parameters when it loads): ``from_pretrained`` reads them through
transformers' own conversions, each rank only the keys of its own layers, to the weights and
numbers of the model ``AutoModelForCausalLM.from_pretrained`` loads; ``save_pretrained``
writes the layout transformers writes; a missing expert is refused by name."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpipe_transformers import from_pretrained
from hf_support.models import EXPERTS, batch, experts_model, largest_grad_difference, reference
from hf_support.ranks import run

pytestmark = pytest.mark.timeout(120) if hasattr(pytest.mark, "timeout") else []

TOLERANCE = 1e-10

#: A layer's index in a key, ``model.layers.1.mlp...``.
LAYER = re.compile(r"\.layers\.(\d+)\.")


def _loaded(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), experts_implementation="eager")
    loaded.train()
    return loaded


def _keys(folder: Path) -> set[str]:
    """The keys of the checkpoint in ``folder``, one file or sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    return set(load_file(folder / "model.safetensors"))


def _stepped(built: torch.nn.Module, lr: float = 0.1) -> torch.nn.Module:
    """A copy of ``built`` after one SGD step of ``lr`` on batch 1 (8 samples)."""
    plain, _, _ = reference(copy.deepcopy(built), batch(1, size=8))
    torch.optim.SGD(plain.parameters(), lr=lr).step()
    return plain


def _largest_difference(one: torch.nn.Module, other: torch.nn.Module) -> float:
    mine, theirs = one.state_dict(), other.state_dict()
    assert set(mine) == set(theirs)
    for key, value in mine.items():
        assert value.dtype == theirs[key].dtype, key
    return max((value - theirs[key]).abs().max().item() for key, value in mine.items())


def _layers(keys: list[str]) -> set[int]:
    return {int(found[1]) for key in keys if (found := LAYER.search(key))}


@pytest.mark.parametrize("family", list(EXPERTS))
def test_transformers_saves_one_tensor_per_expert(family: str, tmp_path: Path) -> None:
    # What the tests below read: the checkpoint's keys are not the model's.
    built = experts_model(family)
    built.save_pretrained(tmp_path)
    keys = _keys(tmp_path)
    assert any(".experts.3." in key for key in keys), sorted(keys)
    assert not any(key.endswith("experts.gate_up_proj") for key in keys)
    assert "model.layers.1.mlp.experts.gate_up_proj" in built.state_dict()


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("family", list(EXPERTS))
def test_experts_on_two_ranks_equal_the_loaded_model_and_save_as_transformers(
    family: str, sharded: bool, tmp_path: Path
) -> None:
    source, out = tmp_path / "source", tmp_path / "out"
    experts_model(family).save_pretrained(source, max_shard_size="8KB" if sharded else "1GB")
    assert (source / "model.safetensors.index.json").is_file() == sharded
    results = run("experts_from_pretrained", folder=str(source), out=str(out))
    checkpoint = _keys(source)
    names = set(_loaded(source).state_dict())
    for rank, found in enumerate(results):
        assert found["weights"] == 0.0, (rank, found["weights"])
        assert found["dtypes"] == [], (rank, found["dtypes"])
        assert found["loss"] < TOLERANCE, (rank, found["loss"])
        assert found["grad"] < TOLERANCE, (rank, found["grad"])
        # Each key read once, and only those of the layers this rank holds.
        assert sorted(found["read"]) == sorted(set(found["read"])), rank
        assert _layers(found["read"]) == _layers(found["held"]), rank
    first, last = results
    assert _layers(first["held"]) == {0, 1} and _layers(last["held"]) == {2, 3}
    assert "model.layers.1.mlp.experts.gate_up_proj" in first["held"]
    assert "model.layers.3.mlp.experts.down_proj" in last["held"]
    # Every key of the checkpoint read, by one rank.
    assert not set(first["read"]) & set(last["read"])
    assert set(first["read"]) | set(last["read"]) == checkpoint
    assert set(first["held"]) | set(last["held"]) == names
    # Written as transformers writes it: the same keys, the dtype in the configuration.
    assert _keys(out) == checkpoint
    assert json.loads((out / "config.json").read_text())["dtype"] == "float64"
    assert _largest_difference(_loaded(out), _stepped(_loaded(source))) < TOLERANCE


@pytest.mark.parametrize("family", list(EXPERTS))
def test_experts_in_one_process_equal_the_loaded_model_and_save_as_transformers(
    family: str, tmp_path: Path
) -> None:
    source, out = tmp_path / "source", tmp_path / "out"
    experts_model(family).save_pretrained(source)
    pipe = from_pretrained(source, balance=[2, 2], chunks=2, experts_implementation="eager")
    loaded = _loaded(source)
    state = pipe.state_dict()
    assert set(state) == set(loaded.state_dict())
    for key, value in loaded.state_dict().items():
        assert value.dtype == state[key].dtype, key
        assert torch.equal(state[key], value), key
    data = batch(1, size=8)
    plain, loss, _ = reference(loaded, data)
    losses = pipe.step(**data)
    assert abs(losses.reduced().item() - loss.item()) < TOLERANCE
    assert largest_grad_difference(pipe.causal_lm, plain) < TOLERANCE
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    pipe.save_pretrained(out)
    assert _keys(out) == _keys(source)
    assert _largest_difference(_loaded(out), _stepped(loaded)) < TOLERANCE


def test_experts_saved_in_the_models_own_layout_are_read(tmp_path: Path) -> None:
    # transformers loads its fused layout too (save_original_format=False writes it).
    built = experts_model("qwen3_moe")
    built.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in _keys(tmp_path)
    state = from_pretrained(tmp_path, balance=[2, 2]).state_dict()
    for key, value in built.state_dict().items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize(
    ("family", "removed", "named"),
    [
        ("qwen3_moe", ["model.layers.1.mlp.experts.2.gate_proj.weight"], "gate_up_proj"),
        ("mixtral", ["model.layers.3.block_sparse_moe.experts.0.w2.weight"], "down_proj"),
        (
            "deepseek_v3",
            [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(4)],
            "down_proj",
        ),
    ],
    ids=["one-expert", "mixtral-names", "every-expert"],
)
def test_a_missing_expert_is_refused_by_its_checkpoint_name(
    family: str, removed: list[str], named: str, tmp_path: Path
) -> None:
    experts_model(family).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    for key in removed:
        del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(KeyError) as refused:
        from_pretrained(tmp_path, balance=[2, 2])
    message = str(refused.value)
    assert "the checkpoint lacks tensors of the model" in message
    assert f"experts.{named}" in message  # the model's name of what it makes
    assert str(file) in message
    for key in removed:
        assert key in message


def test_experts_of_another_shape_than_the_configurations_are_refused(tmp_path: Path) -> None:
    experts_model("qwen3_moe").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["moe_intermediate_size"] = 16  # the weights' is 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    needle = (
        r"the checkpoint's keys \['model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight'.*"
        r"do not make the model's \['model\.layers\.0\.mlp\.experts\.down_proj'\] of its "
        r"shape: the configuration and the weights do not match \(model: \[\(4, 16, 16\)\]"
    )
    with pytest.raises(ValueError, match=needle):
        from_pretrained(tmp_path, balance=[2, 2])
