"""One naming everywhere: the pipeline's parameters, buffers and modules have the plain
module's names, which resolve on the pipeline as on any module (``get_parameter``,
``functional_call``, torch.distributed.checkpoint's ``get_state_dict``)."""

from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch import nn

from gpipe_core import GPipe


def model(batch_norm: bool = True) -> nn.Sequential:
    """Six layers; with ``batch_norm`` a batch norm (buffers), else a ReLU (a micro-batch's
    gradients are then the mini-batch's)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 4),
        nn.BatchNorm1d(4) if batch_norm else nn.ReLU(), nn.Linear(4, 2),
    ).double()  # fmt: skip


def test_names_are_the_plain_modules() -> None:
    plain = model()
    pipe = GPipe(copy.deepcopy(plain), [2, 2, 2], chunks=2)
    for what in ("named_parameters", "named_buffers", "named_modules"):
        got = [name for name, _ in getattr(pipe, what)()]
        want = [name for name, _ in getattr(plain, what)()]
        assert got == want, what
    for name, p in pipe.named_parameters():
        assert pipe.get_parameter(name) is p
    for name, b in pipe.named_buffers():
        assert pipe.get_buffer(name) is b
    assert pipe.get_submodule("3") is pipe[3]
    assert list(pipe.state_dict()) == list(plain.state_dict())


def test_functional_call_with_the_state_dict() -> None:
    plain = model().eval()
    pipe = GPipe(copy.deepcopy(plain), [3, 3], chunks=2).eval()
    x = torch.randn(4, 3, dtype=torch.float64)
    state = {key: value + 0.5 for key, value in pipe.state_dict().items()}
    got = torch.func.functional_call(pipe, state, (x,))
    torch.testing.assert_close(got, torch.func.functional_call(plain, state, (x,)))
    torch.testing.assert_close(pipe(x), plain(x))  # the layers' own tensors are back


def test_name_based_optimizer_groups() -> None:
    pipe = GPipe(model(), [3, 3])
    decay = [p for name, p in pipe.named_parameters() if name.endswith("weight") and p.dim() > 1]
    assert [name for name, p in pipe.named_parameters() if any(p is q for q in decay)] == [
        "0.weight", "3.weight", "5.weight",
    ]  # fmt: skip


def test_train_and_eval_reach_the_partitions_too() -> None:
    pipe = GPipe(model(), [3, 3])
    pipe.eval()
    assert not pipe.partitions.training and not any(p.training for p in pipe.partitions)
    pipe.train()
    assert all(p.training for p in pipe.partitions) and all(layer.training for layer in pipe)


def test_distributed_checkpoint_state_dicts_move_between_the_pipeline_and_the_plain_model() -> None:
    """Model and Adam state under the plain names, from a pipeline to the plain model and to
    a pipeline of another balance; training then goes on alike."""
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    plain = model(False)
    pipe = GPipe(copy.deepcopy(plain), [2, 4], chunks=4)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=0.01)
    opt_pipe = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for _ in range(2):
        for p in (*plain.parameters(), *pipe.parameters()):
            p.grad = None
        nn.MSELoss()(plain(x), y).backward()
        pipe.step(x, y, nn.MSELoss())
        opt_plain.step()
        opt_pipe.step()
    model_state, optim_state = dsd.get_state_dict(pipe, opt_pipe)
    assert list(optim_state["state"]) == [name for name, _ in plain.named_parameters()]
    plain_model_state, plain_optim_state = dsd.get_state_dict(plain, opt_plain)
    assert model_state.keys() == plain_model_state.keys()
    assert optim_state["param_groups"] == plain_optim_state["param_groups"]
    torch.testing.assert_close(optim_state["state"], plain_optim_state["state"])

    # Into another balance and into a fresh plain model, each with a fresh optimizer.
    other = GPipe(model(False), [4, 1, 1], chunks=2)
    opt_other = torch.optim.Adam(other.parameters(), lr=0.01)
    fresh = model(False)
    opt_fresh = torch.optim.Adam(fresh.parameters(), lr=0.01)
    for module, optimizer in ((other, opt_other), (fresh, opt_fresh)):
        dsd.set_state_dict(
            module,
            optimizer,
            model_state_dict=copy.deepcopy(model_state),
            optim_state_dict=copy.deepcopy(optim_state),
        )
    for p in (*plain.parameters(), *other.parameters(), *fresh.parameters()):
        p.grad = None
    nn.MSELoss()(plain(x), y).backward()
    nn.MSELoss()(fresh(x), y).backward()
    other.step(x, y, nn.MSELoss())
    for optimizer in (opt_plain, opt_other, opt_fresh):
        optimizer.step()
    torch.testing.assert_close(other.state_dict(), plain.state_dict())
    torch.testing.assert_close(fresh.state_dict(), plain.state_dict())


class _Prefixed:
    """A renaming that shows each plain key under ``net.``, as a model's own names."""

    def rename(self, key: str) -> str | None:
        return f"net.{key}"

    def key(self, name: str) -> str | None:
        return name.removeprefix("net.") if name.startswith("net.") else None


class _RenamedPipe(GPipe):
    def _renaming(self) -> _Prefixed:
        return _Prefixed()


def test_a_subclass_shows_its_own_names_and_keeps_the_plain_keys_inside() -> None:
    plain = model()
    pipe = _RenamedPipe(copy.deepcopy(plain), [2, 2, 2], chunks=2)
    want = [f"net.{name}" for name, _ in plain.named_parameters()]
    assert [name for name, _ in pipe.named_parameters()] == want
    assert list(pipe.state_dict()) == [f"net.{key}" for key in plain.state_dict()]
    state = {f"net.{key}": value + 1 for key, value in plain.state_dict().items()}
    del state["net.5.bias"]
    result = pipe.load_state_dict(state, strict=False)
    assert result.missing_keys == ["net.5.bias"] and result.unexpected_keys == []
    assert torch.equal(pipe[0].weight, plain[0].weight + 1)
    assert [name for name, _ in pipe._plain_named_parameters()] == [
        name for name, _ in plain.named_parameters()
    ]
