"""Layers built on the meta device: initialised (``reset_parameters()``, then ``init=``) or
refused by name, never left holding uninitialised memory; the documented recipe ("Large
models: build only your own layers") gives the plain model's numbers, in one process and on
two gloo ranks."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from core_support import meta_models
from core_support.meta_models import Block, data, meta_model, plain_model, rebuild_buffers
from gpipe_core import GPipe

SEED = 3
TIGHT = {"rtol": 1e-12, "atol": 1e-13}


def old_recipe(module: nn.Sequential) -> nn.Sequential:
    """What the constructor did before: ``to_empty``, then each ``reset_parameters()``."""
    module.to_empty(device="cpu")
    for layer in module.modules():
        reset = getattr(layer, "reset_parameters", None)
        if callable(reset):
            reset()
    return module


def test_the_old_recipe_leaves_uninitialised_memory() -> None:
    old = old_recipe(meta_model())
    plain = plain_model(SEED)
    for index in (1, 4):
        # Whatever the memory held: not the ones of the norm, not the frequencies.
        assert not torch.equal(old[index].norm.weight, plain[index].norm.weight)
        assert not torch.equal(old[index].rotary.inv_freq, plain[index].rotary.inv_freq)


def test_layers_left_uninitialised_are_refused_by_name() -> None:
    module = meta_model()
    with pytest.raises(ValueError) as caught:
        GPipe(module, [3, 3], chunks=2)
    message = str(caught.value)
    assert message.startswith("layers built on the meta device were left with uninitialised")
    assert "pass GPipe(..., init=...) a function called on each layer made from meta" in message
    for index in (1, 4):
        assert (
            f"module[{index}] (Block): {index}.norm.weight, a parameter of RMSNorm, which has "
            "no reset_parameters()"
        ) in message
        assert (
            f"module[{index}] (Block): {index}.rotary.inv_freq, a non-persistent buffer of "
            "Rotary, which no state dict holds: compute it in init as the constructor does"
        ) in message
    # Linear layers have reset_parameters(): not named.
    assert "linear" not in message and "module[0]" not in message
    # The module is as it was, on the meta device: a retry with init= starts afresh.
    assert all(t.is_meta for t in [*module.parameters(), *module.buffers()])
    GPipe(module, [3, 3], chunks=2, init=[plain_model(SEED).state_dict(), rebuild_buffers])


def test_a_state_dict_cannot_set_a_non_persistent_buffer() -> None:
    state = plain_model(SEED).state_dict()
    assert "1.rotary.inv_freq" not in state
    with pytest.raises(ValueError) as caught:
        GPipe(meta_model(), [3, 3], init=state)
    message = str(caught.value)
    assert "1.rotary.inv_freq, a non-persistent buffer of Rotary" in message
    assert "norm.weight" not in message  # the state dict set it
    # Nor can its key be loaded: a non-persistent buffer is in no state dict.
    state["1.rotary.inv_freq"] = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"keys that module\[1\] \(Block\) does not have, or"):
        GPipe(meta_model(), [3, 3], init=[state, rebuild_buffers])


def recipe(how: str, module: nn.Sequential) -> Any:
    if how == "state":
        return [plain_model(SEED).state_dict(), rebuild_buffers]
    return meta_models.seeded_init(module, SEED)


def expected(how: str) -> nn.Sequential:
    """The plain model on the CPU, initialised as the recipe initialises the pipeline's."""
    plain = plain_model(SEED)
    if how == "seeded":
        init = meta_models.seeded_init(plain, SEED)
        with torch.no_grad():
            for layer in plain:
                init(layer)
    return plain


@pytest.mark.parametrize("how", ["state", "seeded"])
def test_the_recipe_gives_the_plain_models_numbers(how: str) -> None:
    module = meta_model()
    pipe = GPipe(module, [3, 3], chunks=2, init=recipe(how, module))
    plain = expected(how)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, **TIGHT, msg=key)
    for index in (1, 4):
        assert torch.equal(module[index].rotary.inv_freq, plain[index].rotary.inv_freq)
    x, y = data(SEED, 6)
    losses = pipe.step(x, y, nn.MSELoss())
    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    torch.testing.assert_close(losses.reduced(), loss.detach(), **TIGHT)
    grads = dict(pipe.named_parameters())
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, parameter.grad, **TIGHT, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(pipe.eval()(x), plain.eval()(x), **TIGHT)


class Counter(nn.Module):
    """Integer and boolean buffers: a step counter its reset_parameters() zeroes, and a
    mask that only an init sets."""

    def __init__(self, with_reset: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(2, dtype=torch.bool))
        if with_reset:
            self.reset_parameters = self._reset  # type: ignore[method-assign]

    def _reset(self) -> None:
        self.steps.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.mask


def test_integer_and_boolean_buffers() -> None:
    def build(with_reset: bool) -> nn.Sequential:
        with torch.device("meta"):
            return nn.Sequential(Counter(with_reset), nn.BatchNorm1d(2))

    with pytest.raises(ValueError) as caught:
        GPipe(build(False), [2])
    message = str(caught.value)
    assert "0.steps, a buffer of Counter" in message and "0.mask, a buffer of Counter" in message
    # BatchNorm's num_batches_tracked is set by its reset_parameters(); a mask all True,
    # written by init, is initialised although it holds the fill value.
    assert "num_batches_tracked" not in message

    def set_mask(layer: nn.Module) -> None:
        if isinstance(layer, Counter):
            layer.mask.fill_(True)

    pipe = GPipe(build(True), [2], init=set_mask)
    assert pipe.partitions[0][0].steps.item() == 0
    assert pipe.partitions[0][0].mask.tolist() == [True, True]
    assert pipe.partitions[0][1].num_batches_tracked.item() == 0


def test_layers_not_on_meta_are_left_as_they_are() -> None:
    called: list[nn.Module] = []
    plain = plain_model(SEED)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    pipe = GPipe(plain, [3, 3], init=called.append)
    assert not called
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, before[key]), key
    # Only the layers on meta are made and initialised (here, one Block).
    module = plain_model(SEED)
    with torch.device("meta"):
        module[4] = Block().double()
    GPipe(module, [3, 3], init=[called.append, rebuild_buffers, lambda b: b.norm.weight.fill_(1)])
    assert called == [module[4]]
    assert torch.equal(module[4].norm.weight, torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(module[0].weight, plain[0].weight)


@pytest.mark.parametrize(
    ("init", "error", "message"),
    [
        (3, TypeError, "init must be a callable called on each layer made from the meta device"),
        ([rebuild_buffers, "x"], TypeError, r"\(init\[1\]: str\)"),
        ({"0.weight": [1.0]}, TypeError, r"init as a state dict maps the plain model's keys "),
        (
            {"model.0.weight": torch.ones(1)},
            ValueError,
            r"init holds keys of no layer of the module: .*\(init keys: \['model.0.weight'\]",
        ),
    ],
)
def test_init_argument_errors(init: object, error: type[Exception], message: str) -> None:
    module = meta_model()
    with pytest.raises(error, match=message):
        GPipe(module, [3, 3], init=init)  # type: ignore[arg-type]
    assert all(t.is_meta for t in module.parameters())


# -- two gloo ranks -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["state", "seeded"])
def test_the_recipe_on_two_ranks(cluster2: Any, how: str) -> None:
    results = cluster2.results("meta_init", how=how, seed=SEED)
    plain = expected(how)
    x, y = data(SEED, 6)
    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        torch.testing.assert_close(result["reduced"], loss.item(), **TIGHT)
        grads.update(result["grads"])
    assert grads.keys() == dict(plain.named_parameters()).keys()
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, **TIGHT, msg=name)
    assert results[0]["output"] is None
    with torch.no_grad():
        torch.testing.assert_close(results[1]["output"], plain.eval()(x), **TIGHT)


def test_a_refusal_on_one_rank_does_not_hang_the_other(cluster2: Any) -> None:
    results = cluster2.results("meta_init", how="refused", seed=SEED)
    refused, told = results[1]["error"], results[0]["error"]
    assert refused["type"] == "ValueError", results
    assert "4.rotary.inv_freq, a non-persistent buffer of Rotary" in refused["message"]
    assert told["type"] == "RemotePartitionError", results
    assert re.search(r"rank 1\b", told["message"]), told
    assert "4.rotary.inv_freq" in told["message"]
    # A pipeline built next on the group steps on both ranks.
    assert results[0]["reduced"] == results[1]["reduced"]


def tied_model() -> nn.Sequential:
    embedding = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = embedding.weight  # tied, as a language model's input and output
    return nn.Sequential(embedding, nn.Tanh(), head).double()


@pytest.mark.parametrize("balance", [[3], [2, 1]])
def test_tied_weights_stay_tied(balance: list[int]) -> None:
    torch.manual_seed(SEED)
    plain = tied_model()
    with torch.device("meta"):
        module = tied_model()
    # A refusal puts the layers back on meta, tied as they were.
    with pytest.raises(ValueError, match=r"[02].weight, a parameter of (Embedding|Linear), which"):
        GPipe(module, balance, init=lambda layer: layer.weight.fill_(float("nan")))
    assert module[0].weight is module[2].weight and module[0].weight.is_meta
    pipe = GPipe(module, balance, chunks=2, init=plain.state_dict())
    weights = [layer.weight for partition in pipe.partitions for layer in partition[::2]]
    if balance == [3]:
        assert weights[0] is weights[1]
    ids = torch.tensor([0, 3, 1, 4, 2, 2])
    y = torch.randn(6, 5, dtype=torch.float64)
    losses = pipe.step(ids, y, nn.MSELoss())
    loss = nn.MSELoss()(plain(ids), y)
    loss.backward()
    torch.testing.assert_close(losses.reduced(), loss.detach(), **TIGHT)
    assert plain[0].weight.grad is not None
    torch.testing.assert_close(pipe.partitions[0][0].weight.grad, plain[0].weight.grad, **TIGHT)
