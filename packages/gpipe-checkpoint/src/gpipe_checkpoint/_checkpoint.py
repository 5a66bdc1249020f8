"""Checkpointing split into two phases that a scheduler can place independently.

The **checkpoint** phase runs a function without recording autograd history and keeps
only its input (and the generator states and thread state it ran under). The
**recompute** phase runs the function again from that input, with autograd, the same
random draws and the same autocast state; the gradient then flows through the recomputed
graph. Splitting the two lets a pipeline put micro-batch *i*'s recomputation right before
its backward pass.

A :class:`Checkpointing` object holds both phases, and the recomputation can be placed
two ways:

* **by autograd**: :meth:`Checkpointing.checkpoint` returns outputs wired into the
  autograd graph through one node, and :meth:`Checkpointing.recompute_in_backward` arms
  that node: the recomputation runs when the gradient reaches the outputs, inside the
  node's backward. This is how :func:`checkpoint` and ``GPipe.forward`` work::

      chk = Checkpointing(function, batch)
      output = chk.checkpoint()  # forward without autograd history
      chk.recompute_in_backward(output)  # the node recomputes when the gradient arrives

* **by the caller**: ``chk.checkpoint(detached=True)`` returns outputs without any
  autograd history, and :meth:`Checkpointing.recompute` recomputes when the caller says
  so, returning outputs whose graph reaches the input batch's tensors. This is how
  ``GPipe.step`` works: the schedule places each recomputation.

Either way the same two routines run the phases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from gpipe_microbatch import (
    Batch,
    Container,
    TensorOrTensors,
    ThreadState,
    check,
    check_output,
    get_phony,
)

from ._phase import enable_checkpointing, enable_recomputing
from ._rng import RNGStates, replay_rng_states, save_rng_states

__all__ = [
    "Checkpoint",
    "Checkpointing",
    "checkpoint",
    "gradients",
    "is_differentiable",
    "run_backward",
]

#: What :class:`Checkpointing` checkpoints: it takes what a batch holds (its value) and
#: returns a value :func:`~gpipe_microbatch.check_output` accepts.
Function = Callable[[Any], object]

# What the checkpoint phase leaves for the recompute phase: generator states and the
# thread state the first pass ran under.
_Saved = tuple[RNGStates, ThreadState]

# What torch says when a hook is registered on a tensor that does not require grad.
_HOOK_REFUSED = "cannot register a hook on a tensor that doesn't require gradient"

# The values of an output that are not tensors, and where they go: (atomic, present,
# others, the container of the output tuple or mapping), kept without the output's tensors.
_Layout = tuple[bool, tuple[bool, ...], tuple[object, ...], Container]


def _call(function: Function, batch: Batch, tensors: tuple[Tensor, ...]) -> Batch:
    """``function`` on ``batch``'s values with ``tensors`` in place of its tensors."""
    return Batch(check_output(function(batch.with_tensors(tensors).value), "output"))


def is_differentiable(tensor: Tensor) -> bool:
    """Whether ``tensor`` can require grad (a floating-point or complex tensor).

    Example:
        >>> is_differentiable(torch.ones(1)), is_differentiable(torch.ones(1, dtype=torch.long))
        (True, False)
    """
    return tensor.is_floating_point() or tensor.is_complex()


class Checkpointing:
    """The checkpoint and recompute phases of ``function`` applied to ``batch``.

    Args:
        function: takes what the batch holds (:attr:`Batch.value
            <gpipe_microbatch.Batch.value>`) and returns a tensor, or a tuple holding at
            least one tensor (see :func:`~gpipe_microbatch.check_output`). Values that are
            not tensors, in the input or the output, are passed as they are.
        batch: the input; it holds at least one tensor.
        copy_input: give ``function`` copies of the input in both phases, so that it may
            modify its input in place (``nn.ReLU(inplace=True)`` as its first layer).
            Without copies such a function cannot be recomputed, and the checkpoint phase
            raises :class:`RuntimeError`. After :meth:`checkpoint`,
            :attr:`input_modified` tells whether the function did modify its input.
        requires_grad: whether the output needs gradients even when no input does, as
            it does when ``function`` has parameters that require grad (the default).
            Pass False for a function without such parameters, so that its output does
            not require grad unless its input does, as without checkpointing.
        replay: ``replay(device, states)`` returns the context the recompute phase runs
            in to replay the checkpoint phase's random draws (default:
            :func:`replay_rng_states`, the saved generator states under the device's
            generator lock). A scheduler that knows ``function`` draws nothing may skip
            the restore, so that it cannot disturb other threads' draws.
        parameters: every tensor that requires grad which ``function`` uses besides its
            input (a module's parameters). The autograd node placed by :meth:`checkpoint`
            then takes them as inputs and returns their gradients, so that
            :func:`torch.autograd.grad` and ``backward(inputs=...)`` see them as with the
            function itself. Without them (None), the recomputation accumulates into the
            ``.grad`` of whatever the function uses, and only ``.backward()`` is
            supported (:func:`torch.autograd.grad` raises).

    Example:
        >>> layer = torch.nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> chk = Checkpointing(layer, Batch(x))
        >>> output = chk.checkpoint()
        >>> _ = chk.recompute_in_backward(output)
        >>> output.tensor.sum().backward()
        >>> x.grad.shape
        torch.Size([2, 3])

        Placed by the caller:

        >>> leaf = torch.randn(2, 3, requires_grad=True)
        >>> chk = Checkpointing(layer, Batch(leaf))
        >>> chk.checkpoint(detached=True).tensor.requires_grad
        False
        >>> chk.recompute().tensor.sum().backward()
        >>> leaf.grad.shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        function: Function,
        batch: Batch,
        *,
        copy_input: bool = False,
        requires_grad: bool = True,
        replay: Callable[[torch.device, RNGStates], AbstractContextManager[object]] | None = None,
        parameters: Iterable[Tensor] | None = None,
    ) -> None:
        self.function = function
        self.batch = batch
        self.copy_input = copy_input
        #: Whether the checkpoint phase saw ``function`` modify its input in place.
        self.input_modified = False
        self.requires_grad = requires_grad
        self.replay = replay if replay is not None else replay_rng_states
        #: The tensors ``function`` uses besides its input (a module's parameters), or None.
        self.parameters = tuple(parameters) if parameters is not None else None
        # Whether recompute_in_backward() has armed the node, and the phony the
        # checkpoint phase returns next to the outputs.
        self.armed = False
        self.phony: Tensor | None = None
        self.output_layout: _Layout = (True, (True,), (), tuple)
        # Kept by the checkpoint phase for every recomputation (a graph may be
        # differentiated more than once with retain_graph=True).
        self.saved: _Saved | None = None

    # -- the two phases ------------------------------------------------------------

    def _run_checkpoint_phase(self, input: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Run the function on ``input`` without autograd history; keep what the
        recomputation needs."""
        self.saved = (save_rng_states(input[0].device), ThreadState.capture())
        arguments = _copies(input) if self.copy_input else input
        versions = [tensor._version for tensor in arguments]
        try:
            with torch.no_grad(), enable_checkpointing():
                output = _call(self.function, self.batch, arguments)
        except RuntimeError as error:
            if _HOOK_REFUSED not in str(error):
                raise
            raise RuntimeError(
                "a checkpointed function registered a hook on a tensor (tensor.register_hook) "
                "in its checkpoint phase, which runs without autograd, so the tensor does not "
                "require grad; register the hook only when is_checkpointing() is False "
                "(gpipe.is_checkpointing(); the recomputation, where gpipe.is_recomputing() is "
                "True, registers it and backward calls it), or turn checkpointing off for this "
                f"block (GPipe(..., checkpoint='never')) (error: {error})"
            ) from error
        self.input_modified = any(
            tensor._version != version for tensor, version in zip(arguments, versions, strict=False)
        )
        if self.input_modified and not self.copy_input:
            # The recomputation needs the input as it was; it is gone.
            raise RuntimeError(
                "a checkpointed function modified its input in place, so it cannot be "
                "recomputed for backward (a layer such as nn.ReLU(inplace=True) at the start "
                "of a checkpointed block); pass copy_input=True, make that layer "
                "out-of-place, or turn checkpointing off for this block"
            )
        self.output_layout = (output.atomic, output.present, output.others, output.container)
        return output.tensors

    def _output(self, tensors: Iterable[Tensor]) -> Batch:
        """The checkpoint phase's output with ``tensors`` as its tensors."""
        atomic, present, others, container = self.output_layout
        return Batch.from_parts(atomic, present, tensors, others, container)

    def _run_recompute_phase(self, input: tuple[Tensor, ...]) -> Batch:
        """Run the function again on ``input``, with autograd, as the checkpoint phase ran."""
        assert self.saved is not None, "the checkpoint phase has not run"
        rng_states, thread_state = self.saved
        with (
            self.replay(input[0].device, rng_states),
            thread_state.apply(),
            torch.enable_grad(),
            enable_recomputing(),
        ):
            # Copies are differentiable, so the gradient still reaches the input.
            arguments = _copies(input) if self.input_modified else input
            return _call(self.function, self.batch, arguments)

    # -- placed by autograd ----------------------------------------------------------

    def checkpoint(self, join: Tensor | None = None, *, detached: bool = False) -> Batch:
        """Run the checkpoint phase: the function without autograd history.

        Args:
            join: a phony (:func:`~gpipe_microbatch.get_phony`) forked off earlier work,
                such as the one :meth:`recompute_in_backward` returns, to join to this
                phase as if it were joined to the input: in backward, the phony's branch is
                released once this phase's backward is done. Saves an autograd node per
                ordering edge.
            detached: return outputs without any autograd history; the caller then runs
                :meth:`recompute` itself. Otherwise the outputs hang off one autograd node
                that recomputes in backward once :meth:`recompute_in_backward` has armed it.

        Returns:
            The output batch.
        """
        if detached:
            return self._output(self._run_checkpoint_phase(self.batch.tensors))
        # The phony requires grad, so the output joins the graph even where the input
        # does not require grad: the parameters inside ``function`` need gradients.
        phony = join
        if phony is None or not (phony.requires_grad and torch.is_grad_enabled()):
            phony = get_phony(self.batch[0].device, requires_grad=self.requires_grad)
        *output, self.phony = Checkpoint.apply(  # type: ignore[no-untyped-call]
            phony, self, *self.batch, *(self.parameters or ())
        )
        return self._output(output)

    def recompute_in_backward(self, batch: Batch) -> Tensor:
        """Arm the recompute phase on ``batch``, the output of :meth:`checkpoint`.

        The recomputation then runs when the gradient reaches the outputs in ``batch``,
        right before the checkpoint phase's backward, in the same autograd node.

        Returns:
            A phony (:func:`~gpipe_microbatch.get_phony`) forked off the outputs: the
            recomputation also waits for the phony's gradient, so joining it to
            later work orders that work's backward before this recomputation. Without
            autograd (no output needs a gradient) it carries no edge.
        """
        self.armed = True
        # Not kept: the phony's graph holds this object, which would make a cycle.
        phony, self.phony = self.phony, None
        if phony is None or not any(tensor.requires_grad for tensor in batch):
            return get_phony(batch[0].device, requires_grad=False)
        return phony

    # -- placed by the caller --------------------------------------------------------

    def recompute(self) -> Batch:
        """Run the recompute phase now (after ``checkpoint(detached=True)``).

        Returns:
            The output batch, with the autograd graph of the recomputation: it reaches
            the input batch's tensors and the function's parameters.
        """
        return self._run_recompute_phase(self.batch.tensors)


# The engine call behind torch.autograd.backward (torch >= 2.3), if this torch has it.
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def run_backward(
    tensors: Sequence[Tensor | GradientEdge],
    grads: Sequence[Tensor],
    *,
    inputs: Sequence[Tensor] = (),
    retain_graph: bool = False,
) -> None:
    """``torch.autograd.backward(tensors, grads, inputs=inputs or None, retain_graph=...)``,
    minus its argument checks when needless.

    :func:`torch.autograd.backward` checks and converts its arguments in Python on every
    call, which costs about as much as a small layer's backward pass. Where each gradient
    is a plain tensor (of its tensor's shape and dtype; the engine checks an edge's
    gradient against its node), as autograd itself produces them, the engine is called
    directly; otherwise through :func:`torch.autograd.backward`, with its checks and
    errors. Gradients accumulate into the leaves' ``.grad`` (only those of ``inputs``, if
    given).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> run_backward([x * 3], [torch.ones(2)])
        >>> x.grad
        tensor([3., 3.])
    """
    if _engine_run_backward is None or not _plain(tensors, grads):
        torch.autograd.backward(
            cast(list[Tensor], list(tensors)),
            list(grads),
            retain_graph=retain_graph,
            inputs=list(inputs) or None,
        )
        return
    _engine_run_backward(
        tuple(tensors), tuple(grads), retain_graph, False, tuple(inputs),
        allow_unreachable=True, accumulate_grad=True,
    )  # fmt: skip


def gradients(
    tensors: Sequence[Tensor | GradientEdge],
    grads: Sequence[Tensor],
    inputs: Sequence[Tensor | GradientEdge],
    *,
    retain_graph: bool = False,
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(tensors, inputs, grads, retain_graph=..., allow_unused=True)``,
    minus its argument checks when needless (see :func:`run_backward`).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> gradients([x * 3], [torch.ones(2)], [x])
        (tensor([3., 3.]),)
    """
    if _engine_run_backward is None or not _plain(tensors, grads):
        return torch.autograd.grad(
            cast(list[Tensor], list(tensors)),
            cast(list[Tensor], list(inputs)),
            list(grads),
            retain_graph=retain_graph,
            allow_unused=True,
        )
    result: tuple[Tensor | None, ...] = _engine_run_backward(
        tuple(tensors), tuple(grads), retain_graph, False, tuple(inputs),
        allow_unreachable=True, accumulate_grad=False,
    )  # fmt: skip
    return result


def _plain(tensors: Sequence[Tensor | GradientEdge], grads: Sequence[Tensor]) -> bool:
    """Whether each gradient is a plain tensor of its tensor's shape and dtype (so the
    engine may be called without torch.autograd's checks and conversions); an edge's
    gradient need only be a plain tensor (the engine checks it against the edge's node)."""
    return all(
        type(grad) is Tensor
        and (
            isinstance(tensor, GradientEdge)
            or (
                type(tensor) is Tensor and tensor.shape == grad.shape and tensor.dtype == grad.dtype
            )
        )
        for tensor, grad in zip(tensors, grads, strict=True)
    )


def _copies(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(tensor.clone() for tensor in tensors)


class Checkpoint(torch.autograd.Function):
    """Both phases in one autograd node: forward without history; in backward, recompute
    the function with autograd and pass the gradients through the recomputed graph.

    Called as ``Checkpoint.apply(phony, checkpointing, *input, *parameters)``; returns the
    outputs and a phony (see :meth:`Checkpointing.recompute_in_backward`). One node rather
    than one per phase: the recomputation runs right before the checkpoint phase's backward
    either way, and each autograd node of a Python function costs several microseconds.

    Second-order gradients (a backward pass with ``create_graph=True``) are refused: the
    gradients this node returns are computed from a recomputed graph cut at the node's
    input, so a graph of them would miss every path through the input.
    """

    @staticmethod
    def forward(
        ctx: Any, phony: Tensor, chk: Checkpointing, *input_and_parameters: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.chk = chk
        input = input_and_parameters[: len(chk.batch)]
        ctx.save_for_backward(*input)
        # Unused outputs (and the phony) pass no gradient (None) to the recomputed graph.
        ctx.set_materialize_grads(False)
        tensors = chk._run_checkpoint_phase(input)
        ctx.mark_non_differentiable(*(t for t in tensors if not is_differentiable(t)))
        phony = get_phony(input[0].device, requires_grad=False).detach()
        return (*tensors, phony)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor | None) -> tuple[Tensor | None, ...]:
        chk: Checkpointing = ctx.chk
        if not chk.armed:
            raise RuntimeError(
                "a checkpointed output reached backward without its recomputation "
                "(call Checkpointing.recompute_in_backward on the output of "
                "Checkpointing.checkpoint)"
            )
        if torch.is_grad_enabled():  # the engine runs backward in grad mode = create_graph
            raise RuntimeError(
                "checkpointing cannot give second-order gradients (a backward pass with "
                "create_graph=True through a checkpointed function): the recomputed graph "
                "is cut at the function's input; turn checkpointing off for such a backward "
                "pass (GPipe(..., checkpoint='never'))"
            )
        # A whole backward pass (.backward()) accumulates into .grad of every leaf the
        # recomputed graph reaches; one that wants some inputs only (torch.autograd.grad,
        # .backward(inputs=...)) gets the gradients of the input and of the parameters
        # returned, as the function itself would give them.
        whole = torch.autograd._is_checkpoint_valid()  # type: ignore[no-untyped-call]
        parameters = chk.parameters
        if not whole and parameters is None:
            raise RuntimeError(
                "checkpointing works with .backward() only, not with torch.autograd.grad() "
                "or .backward(inputs=...), unless the checkpointed function's parameters are "
                "given (Checkpointing(..., parameters=...)): the recomputed graph accumulates "
                "into .grad"
            )
        input_leaf = tuple(
            tensor.detach().requires_grad_(tensor.requires_grad) for tensor in ctx.saved_tensors
        )
        tensors = chk._run_recompute_phase(input_leaf).tensors
        pairs = [
            (tensor, grad)
            for tensor, grad in zip(tensors, grad_output[:-1], strict=False)
            if tensor.requires_grad and grad is not None
        ]
        roots, seeds = [t for t, _ in pairs], [g for _, g in pairs]
        grad_input: list[Tensor | None] = [None, None]
        if whole or parameters is None:
            if pairs:
                run_backward(roots, seeds)
            grad_input.extend(leaf.grad for leaf in input_leaf)
            grad_input.extend(None for _ in parameters or ())  # accumulated already
            return tuple(grad_input)
        wanted = [t for t in (*input_leaf, *parameters) if t.requires_grad]
        found = iter(gradients(roots, seeds, wanted) if pairs and wanted else [None] * len(wanted))
        grad_input.extend(next(found) if t.requires_grad else None for t in input_leaf)
        grad_input.extend(next(found) if t.requires_grad else None for t in parameters)
        return tuple(grad_input)


def checkpoint(function: Function, input: TensorOrTensors) -> TensorOrTensors:
    """Run ``function(input)`` without keeping its activations; recompute them in backward.

    Only ``input`` is kept; the activations inside ``function`` are recomputed when the
    gradient arrives, with the same random draws (dropout masks) and autocast state.
    Without autograd (``torch.no_grad()``) this is ``function(input)``.

    Args:
        function: takes a tensor or a tuple of tensors and returns one of those.
        input: a tensor or a tuple of tensors.

    Returns:
        What ``function`` returns.

    Raises:
        TypeError: ``input`` or the output is not a tensor or a tuple of tensors.

    Example:
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = checkpoint(block, x)
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    batch = Batch(check(input, "input"))

    def tensors_only(value: Any) -> TensorOrTensors:
        return check(function(value), "output")

    if not torch.is_grad_enabled():
        return tensors_only(batch.value)
    # A module without trainable parameters needs no gradient unless its input does; any
    # other function may close over tensors that do.
    requires_grad = not isinstance(function, torch.nn.Module) or any(
        parameter.requires_grad for parameter in function.parameters()
    )
    parameters = function.parameters() if isinstance(function, torch.nn.Module) else None
    chk = Checkpointing(tensors_only, batch, requires_grad=requires_grad, parameters=parameters)
    output = chk.checkpoint()
    chk.recompute_in_backward(output)
    return cast(TensorOrTensors, output.value)
