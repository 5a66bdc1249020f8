"""The router loss of a mixture of experts (``output_router_logits=True``): a step's
``reduced()`` is the model's loss, the labels loss plus its coefficient times the
load-balancing loss over every layer and the whole mini-batch (padding left out), and the
gradients are the model's, in one process and across ranks; a schedule that starts a
backward pass before every forward pass ends, a family whose loss adds other router
terms, and a step without labels are refused by name, before anything runs."""

from __future__ import annotations

import copy

import pytest
import torch

from gpipe_transformers import LayoutError, pipeline
from hf_support.models import (
    batch,
    experts_model,
    largest_grad_difference,
    model,
    reference,
    router_reference,
)
from hf_support.ranks import run

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []

#: transformers sums the router statistics in float32.
TOLERANCE = 1e-6


def _routed(family: str, **extra: object) -> torch.nn.Module:
    return experts_model(family, router_aux_loss_coef=0.5, output_router_logits=True, **extra)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_router_loss_is_the_models(family: str, chunks: int, checkpoint: str) -> None:
    built = _routed(family)
    data = batch(1, size=8)
    plain, loss, aux = router_reference(built, data)
    labels_only, _, _ = reference(built, data)
    # The router loss moves the gradients far more than the tolerance: leaving it out fails.
    assert largest_grad_difference(labels_only, plain) > 1e3 * TOLERANCE
    pipe = pipeline(built, balance=[2, 2], chunks=chunks, checkpoint=checkpoint)  # type: ignore[arg-type]
    losses = pipe.step(**data)
    assert abs(losses.reduced().item() - loss.item()) <= TOLERANCE
    assert abs(losses.aux_loss.item() - aux.item()) <= TOLERANCE
    assert largest_grad_difference(built, plain) <= TOLERANCE
    # Each micro-batch's loss is its labels loss; reduced() adds the router loss once.
    assert len(losses) == chunks
    assert losses.reduced().item() == pytest.approx(
        sum(n * x.item() for n, x in zip(losses.counts or (), losses, strict=True))
        / sum(losses.counts or ())
        + 0.5 * losses.aux_loss.item(),
        abs=1e-12,
    )


def test_router_loss_by_the_call() -> None:
    # The call's output_router_logits, over the config's.
    built = experts_model("mixtral", router_aux_loss_coef=0.5)
    data = batch(2, size=8)
    plain, loss, _ = router_reference(built, data)
    labels_only, labels_loss, _ = reference(built, data)
    pipe = pipeline(copy.deepcopy(built), balance=[1, 3], chunks=4)
    with_router = pipe.step(**data, output_router_logits=True)
    assert abs(with_router.reduced().item() - loss.item()) <= TOLERANCE
    assert largest_grad_difference(pipe, plain) <= TOLERANCE
    pipe.zero_grad(set_to_none=True)
    without = pipe.step(**data)
    assert not hasattr(without, "aux_loss")
    assert abs(without.reduced().item() - labels_loss.item()) <= 1e-10
    assert largest_grad_difference(pipe, labels_only) <= 1e-10

    routed = pipeline(_routed("mixtral"), balance=[2, 2], chunks=2)
    assert not hasattr(routed.step(**data, output_router_logits=False), "aux_loss")


def test_router_loss_refusals_leave_the_pipeline_usable() -> None:
    built = _routed("qwen3_moe")
    data = batch(3, size=8)
    plain, loss, _ = router_reference(built, data)
    pipe = pipeline(built, balance=[2, 2], chunks=4)
    for schedule in ("1f1b", "zbh1"):
        with pytest.raises(ValueError, match=rf"schedule='{schedule}'.*use schedule='gpipe'"):
            pipe.step(**data, schedule=schedule)
    with pytest.raises(TypeError, match="pass labels=, or output_router_logits=False"):
        pipe.step(input_ids=data["input_ids"], target=data["labels"], loss_fn=pipe.loss)
    mask = data["attention_mask"][:, None, None, :].expand(8, 1, 10, 10)
    with pytest.raises(ValueError, match=r"2-dimensional attention mask.*\(8, 1, 10, 10\)"):
        pipe.step(input_ids=data["input_ids"], attention_mask=mask, labels=data["labels"])
    with pytest.raises(ValueError, match="forward returns the logits only; step"):
        pipe(input_ids=data["input_ids"], output_router_logits=True)
    assert all(p.grad is None for p in pipe.parameters())
    losses = pipe.step(**data, schedule="gpipe")
    assert abs(losses.reduced().item() - loss.item()) <= TOLERANCE
    assert largest_grad_difference(built, plain) <= TOLERANCE


def test_model_without_routers_is_refused() -> None:
    pipe = pipeline(model("llama"), balance=[2, 2], chunks=2)
    with pytest.raises(ValueError, match="records no router logits"):
        pipe.step(**batch(0), output_router_logits=True)


def test_family_with_other_router_terms_is_refused() -> None:
    # A loss that adds a term of its own (a z-loss, say) is not the one gpipe computes.
    built = _routed("mixtral")
    family = type(built)

    def with_z_loss(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        out = family.forward(self, *args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 0.01 * out.logits.logsumexp(-1).square().mean()
        return out

    built.__class__ = type(family.__name__, (family,), {"forward": with_z_loss})
    with pytest.raises(LayoutError, match="adds router terms gpipe does not compute"):
        pipeline(built, balance=[2, 2], chunks=2)
    # Without the router loss, it pipelines.
    built.config.output_router_logits = False
    pipe = pipeline(built, balance=[2, 2], chunks=2)
    with pytest.raises(LayoutError, match="adds router terms gpipe does not compute"):
        pipe.step(**batch(0), output_router_logits=True)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_loss_across_ranks(family: str) -> None:
    # Every rank's losses (the last rank's, shared), and its own gradients.
    for rank, found in enumerate(run("router_exact", world=2, family=family)):
        for chunks, (loss, aux, grad) in found.items():
            assert loss is not None and loss <= TOLERANCE, (rank, chunks, loss)
            assert aux is not None and aux <= TOLERANCE, (rank, chunks, aux)
            assert grad <= TOLERANCE, (rank, chunks, grad)


def test_router_loss_over_replicas() -> None:
    # Each rank a whole pipeline on half of the batch: the router statistics are summed
    # over both, as the plain model's over the whole batch; each replica's loss is its
    # own labels loss plus that router loss.
    for rank, found in enumerate(run("router_exact", world=2, family="mixtral", replicas=True)):
        for chunks, (loss, aux, grad) in found.items():
            assert aux is not None and aux <= TOLERANCE, (rank, chunks, aux)
            assert grad <= TOLERANCE, (rank, chunks, grad)
            assert loss is not None and loss <= TOLERANCE, (rank, chunks, loss)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_loss_from_pretrained(family: str, tmp_path: object) -> None:
    # A model read on the meta device is checked on its family's load-balancing function.
    from gpipe_transformers import from_pretrained

    built = _routed(family)
    built.save_pretrained(str(tmp_path))
    data = batch(1, size=8)
    plain, loss, _ = router_reference(built, data)
    pipe = from_pretrained(str(tmp_path), balance=[2, 2], chunks=4, experts_implementation="eager")
    pipe.train()
    losses = pipe.step(**data)
    assert abs(losses.reduced().item() - loss.item()) <= TOLERANCE
    assert largest_grad_difference(pipe, plain) <= TOLERANCE


def test_a_failed_step_across_ranks_leaves_the_router_loss_exact() -> None:
    # The last rank's loss fails; every rank's step fails, and the next step is exact.
    for found in run("router_recovers", world=2):
        assert "error" in found, found
        assert found["loss"] <= TOLERANCE and found["grad"] <= TOLERANCE, found
