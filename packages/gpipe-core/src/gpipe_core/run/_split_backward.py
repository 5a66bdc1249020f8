"""The backward pass split in two: the input gradient now, the weight gradient later.

A zero-bubble schedule runs a micro-batch's backward pass in two actions (see
:mod:`gpipe_core.schedule._action`): the input gradient ``I`` (sent upstream at once) and the
weight gradient ``W`` (deferred). :meth:`SplitBackward.input_gradient` runs ``I`` and
returns the :class:`WeightGradient` that runs ``W``; together they compute what one
backward pass does, each node of the autograd graph computes once, and each hook on a
tensor runs once, as in one backward pass.

**How the graph is cut.** From the roots (the outputs that received a gradient, the loss),
the *input path* is every node from which one of the wanted inputs can be reached. ``I``
runs the input path only: autograd computes only the outputs of a node that lead to the
inputs (a linear layer's ``AddmmBackward`` computes its input's gradient, not its weight's).
The nodes of the input path that also lead to leaves off it (parameters) are the *frontier*:
a pre-hook captures the gradient flowing into each during ``I`` (after the hooks on its
tensor, which run then, once). The roots off the input path (a loss where no input needs a
gradient, an output computed from parameters only) are differentiated whole by ``W``.

**The weight gradient** is one autograd call, from the edges that leave the input path,
down to the leaves; nothing of the input path runs again. Autograd cannot start inside a
node, after its tensor's hooks: starting ``W`` at a frontier node would run the hooks on
its tensor (``Tensor.register_hook``, ``retain_grad()``) a second time. So ``W`` first
calls each frontier node itself, with the gradient captured at ``I`` (a node called so
runs no hook), inside an autograd call that asks only for the edges leaving the input path
(it computes the weight's side only, a linear layer's weight gradient and not its input's
again); what they return seeds the autograd call down to the leaves, where the hooks of
the tensors off the input path (a parameter's included) run, once.

**Nodes that run whole at ``I``.** The backward of a custom ``autograd.Function`` returns
every gradient it computes, whichever are asked for; a compiled graph's
(``CompiledFunctionBackward``: a partition or layer compiled by ``torch.compile`` with
``aot_eager`` or ``inductor``) is one such function. Such a node on the frontier runs
whole, once, at ``I``; a post-hook keeps what it returns for the parameters' side, which
seeds ``W``. So does a frontier node inside a non-reentrant ``torch.utils.checkpoint``
(``use_reentrant=False``): calling it again at ``W`` would recompute the checkpointed
region a second time (its forward pass, a batch norm's running statistics included), so
it computes its weights' gradients at ``I`` (the gradients are asked for at the edges below
it, where the hooks on those tensors run, once, at ``I``); the rest of ``W`` below it
(operations on parameters inside the region) uses what the region's one recomputation,
at ``I``, saved: ``I`` and ``W`` of a micro-batch run in one
:class:`torch.utils.checkpoint.GraphExecGroup`. A layer compiled with ``backend="eager"``
records the usual nodes and splits as usual. Where every frontier node runs whole (a
partition compiled whole, or all of whose layers with parameters are checkpointed so),
:attr:`SplitBackward.whole` says so: the partition runs its whole backward pass at ``I``
(a backward task on the timeline) and its ``W`` is empty. A reentrant checkpoint
(``use_reentrant=True``) refuses a backward pass to chosen inputs, so a partition with one
runs its whole backward pass at ``I`` as well. (``checkpoint=`` of the pipeline itself
recomputes a micro-batch once, before ``I``, and keeps ``W`` deferred.)

One case runs a tensor's hooks twice, each time on its part of the gradient (the
gradients stay exact for hooks that are linear): a tensor that a layer inside a
non-reentrant checkpoint uses directly (its parameter), which an output computed from
parameters only (a root off the input path) also uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from gpipe_checkpoint import gradients, run_backward

__all__ = ["SplitBackward", "WeightGradient", "checkpoints_itself"]


_Grads = tuple[Tensor | None, ...]

#: What torch's non-reentrant checkpoint saves in place of a tensor (None if torch has
#: no such class).
_HOLDER: type | None = getattr(torch.utils.checkpoint, "_Holder", None)
#: Backward calls under one group recompute a non-reentrant checkpoint once.
_EXEC_GROUP: Any = getattr(torch.utils.checkpoint, "GraphExecGroup", None)


class WeightGradient:
    """The weight gradient of one micro-batch, made by :meth:`SplitBackward.input_gradient`:
    calling it accumulates the leaves' gradients (into ``.grad``) and frees the graph.

    Args:
        called: the nodes ``W`` calls itself, each with its input (the frontier nodes,
            with the gradient captured at ``I``), and what each sends on (its edges off
            the input path, by position).
        seeds: the autograd call's seeds (edges below the nodes run whole at ``I``, roots
            off the input path) and their gradients.
        leaves: the leaves the weight gradient reaches.
        group: the micro-batch's checkpoint group (see :func:`_in_group`).
    """

    __slots__ = ("called", "group", "leaves", "seeds")

    def __init__(
        self,
        called: list[tuple[Node, _Grads, dict[int, GradientEdge]]] | None = None,
        seeds: list[tuple[Tensor | GradientEdge, Tensor]] | None = None,
        leaves: list[Tensor] | None = None,
        group: object = None,
    ) -> None:
        self.called = called or []
        self.seeds = seeds or []
        self.leaves = leaves or []
        self.group = group

    def __call__(self) -> None:
        called, seeds, leaves = self.called, self.seeds, self.leaves
        self.called, self.seeds, self.leaves = [], [], []
        if not leaves or not (called or seeds):
            return
        with _in_group(self.group):
            if called:
                seeds = [*seeds, *_call_nodes(called)]
            if seeds:
                # Tensors and edges mixed, as autograd takes them.
                run_backward(
                    [seed for seed, _ in seeds],
                    [grad for _, grad in seeds],
                    inputs=leaves,
                    retain_graph=True,
                )


class SplitBackward:
    """The backward pass of ``roots`` (with gradients ``seeds``) split at ``wanted``: the
    graph is read once, then :meth:`input_gradient` runs.

    Args:
        roots: the tensors to differentiate (outputs that received a gradient, a loss).
        seeds: their gradients.
        wanted: the inputs whose gradients the input gradient computes.
    """

    def __init__(
        self, roots: Sequence[Tensor], seeds: Sequence[Tensor], wanted: Sequence[Tensor]
    ) -> None:
        self.roots, self.seeds, self.wanted = roots, seeds, wanted
        self.inputs = {_node(tensor): k for k, tensor in enumerate(wanted)}
        self.nodes = [_node(root) for root in roots]
        self.graph = graph = _Graph(self.nodes, self.inputs)
        #: The frontier nodes that split: ``W`` calls them again for the parameters' side.
        self.frontier: list[Node] = []
        #: The frontier nodes that run whole at ``I``; those of them inside a non-reentrant
        #: checkpoint (not custom functions) compute the parameters' side only if asked.
        self.whole_nodes: list[Node] = []
        #: The children off the input path of the nodes that run whole at ``I`` and are
        #: checkpointed, with their count of inputs: ``I`` asks for their gradients.
        self.targets: dict[Node, int] = {}
        #: Whether the graph has a reentrant checkpoint (``torch.utils.checkpoint`` with
        #: ``use_reentrant=True``), on the input path or off it: it refuses a backward
        #: pass to chosen inputs, which both ``I`` and ``W`` are.
        self.reentrant = any(
            type(node).__name__ == "CheckpointFunctionBackward" for node in graph.edges
        )
        #: The frontier nodes' edges off the input path, by position.
        self.off: dict[Node, dict[int, GradientEdge]] = {}
        for node in graph.path:
            off = {
                k: GradientEdge(child, nr)
                for k, (child, nr) in enumerate(graph.edges[node])
                if child is not None and child not in self.inputs and graph.leafward(child)
            }
            if not off:
                continue
            self.off[node] = off
            if _unsplittable(node):
                self.whole_nodes.append(node)
            elif _checkpointed(node):
                self.whole_nodes.append(node)
                for edge in off.values():
                    self.targets.setdefault(edge.node, len(edge.node._input_metadata))
            else:
                self.frontier.append(node)
        #: The roots that lead to an input (or are one), and those off the input path
        #: that lead to a leaf (differentiated whole by the weight gradient).
        self.on_path = [k for k, node in enumerate(self.nodes) if graph.to_input.get(node, False)]
        self.off_path = [
            k
            for k, node in enumerate(self.nodes)
            if not graph.to_input.get(node, False) and graph.leafward(node)
        ]
        #: The leaves off the input path (the weight gradient's).
        self.leaves: list[Tensor] = [
            node.variable  # type: ignore[attr-defined]
            for node in graph.edges
            if _is_leaf_node(node)
        ]

    @property
    def whole(self) -> bool:
        """Whether the backward pass runs whole, at the input gradient: nothing of the
        parameters' side can wait for a weight gradient (every frontier node computes
        its parameters' gradients at ``I``: a compiled partition's, or a partition whose
        layers with parameters are all under a non-reentrant checkpoint), or the graph
        has a reentrant checkpoint."""
        return self.reentrant or (
            bool(self.whole_nodes) and not self.frontier and not self.off_path
        )

    def input_gradient(self) -> tuple[list[Tensor | None], WeightGradient]:
        """Differentiate the roots to ``wanted`` only.

        Returns:
            The gradient of each of ``wanted`` (None where none flowed), and what the
            weight gradient runs later (see the module's docstring).
        """
        roots, seeds, wanted = self.roots, self.seeds, self.wanted
        group = _EXEC_GROUP() if _EXEC_GROUP is not None else None
        captured: dict[Node, _Grads] = {}
        returned: dict[Node, _Grads] = {}
        asked = [GradientEdge(node, nr) for node, n in self.targets.items() for nr in range(n)]
        grads: list[Tensor | None] = [None] * len(wanted)
        found_targets: Sequence[Tensor | None] = [None] * len(asked)
        if self.on_path and wanted:
            hooks = [node.register_prehook(_capture(captured, node)) for node in self.frontier]
            hooks += [node.register_hook(_returned(returned, node)) for node in self.whole_nodes]
            try:
                with _in_group(group):
                    found = gradients(
                        [roots[k] for k in self.on_path],
                        [seeds[k] for k in self.on_path],
                        [*wanted, *asked],
                        retain_graph=True,
                    )
            finally:
                for hook in hooks:
                    hook.remove()
            grads = list(found[: len(wanted)])
            found_targets = found[len(wanted) :]
        # The targets whose hooks ran at I: their whole input came from the input path
        # (else one of their inputs waits for W, and autograd never reached them at I).
        inputs_of: dict[Node, list[Tensor | None]] = {}
        for edge, grad in zip(asked, found_targets, strict=True):
            inputs_of.setdefault(edge.node, []).append(grad)
        reached = {
            node: tuple(slots)
            for node, slots in inputs_of.items()
            if any(grad is not None for grad in slots)
        }
        called: list[tuple[Node, _Grads, dict[int, GradientEdge]]] = []
        for node in self.frontier:
            grads_in = captured.get(node)
            if grads_in is not None and any(grad is not None for grad in grads_in):
                called.append((node, grads_in, _not_in(self.off[node], reached)))
        for node, grads_in in reached.items():
            children = {
                k: GradientEdge(child, nr)
                for k, (child, nr) in enumerate(self.graph.edges[node])
                if child is not None and self.graph.leafward(child)
            }
            called.append((node, grads_in, _not_in(children, reached)))
        weight_seeds: list[tuple[Tensor | GradientEdge, Tensor]] = []
        for node in self.whole_nodes:
            outputs = returned.get(node, ())
            for k, edge in self.off[node].items():
                grad = outputs[k] if k < len(outputs) else None
                if grad is not None and edge.node not in reached:
                    weight_seeds.append((edge, grad))
        for k in self.off_path:
            weight_seeds.append((roots[k], seeds[k]))
        return grads, WeightGradient(called, weight_seeds, self.leaves, group)


def _not_in(edges: dict[int, GradientEdge], reached: dict[Node, _Grads]) -> dict[int, GradientEdge]:
    """``edges`` less those into a node whose whole input was captured at ``I``."""
    return {k: edge for k, edge in edges.items() if edge.node not in reached}


def _in_group(group: object) -> AbstractContextManager[object]:
    """Run backward calls under ``group`` (a :class:`torch.utils.checkpoint.GraphExecGroup`):
    a non-reentrant checkpoint they reach recomputes its region once for all of them. Where
    the thread is in a group already (the caller's), that group serves."""
    if group is None or _EXEC_GROUP._get_current_group() is not None:
        return nullcontext()
    return group  # type: ignore[return-value]


def _call_nodes(
    called: list[tuple[Node, _Grads, dict[int, GradientEdge]]],
) -> list[tuple[GradientEdge, Tensor]]:
    """Call each node of ``called`` with its input, without its hooks (those ran at ``I``),
    computing only its outputs along its edges listed; return them as seeds.

    A node called outside an autograd call computes every output (a linear layer's input
    gradient again); inside one, only those whose edge leads to a node autograd wants. So
    the nodes are called inside an autograd call of a node of its own (from its pre-hook),
    which wants the gradients into the edges' nodes: it never reaches them (nothing runs
    there). A leaf's
    node (``AccumulateGrad``) called so accumulates its input.
    """
    wanted: dict[Node, None] = {}
    for _, _, edges in called:
        for edge in edges.values():
            wanted.setdefault(edge.node)
    seeds: list[tuple[GradientEdge, Tensor]] = []

    def call(*_: object) -> None:
        with torch.no_grad():
            for node, grads_in, edges in called:
                if not edges and not _is_leaf_node(node):
                    continue
                outputs = node(*grads_in)  # type: ignore[operator]
                if outputs is None or isinstance(outputs, Tensor):  # a node of one output
                    outputs = (outputs,)
                for k, edge in edges.items():
                    grad = outputs[k] if k < len(outputs) else None
                    if grad is not None:
                        seeds.append((edge, grad))

    if not wanted:
        call()  # leaves' nodes only: they compute nothing to ask for
        return seeds
    leaf = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        start = leaf.view_as(leaf)
    assert start.grad_fn is not None
    handle = start.grad_fn.register_prehook(call)
    try:
        # The leaf among the inputs: else autograd sees that its root leads to none of
        # them, and runs nothing.
        gradients([start], [torch.ones(())], [leaf, *(GradientEdge(node, 0) for node in wanted)])
    finally:
        handle.remove()
    return seeds


def _node(tensor: Tensor) -> Node:
    """The node gradients of ``tensor`` flow into: its ``grad_fn``, or a leaf's
    ``AccumulateGrad``."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    with torch.enable_grad():
        view = tensor.view_as(tensor)
    assert view.grad_fn is not None
    node = view.grad_fn.next_functions[0][0]
    assert node is not None
    return node


def _unsplittable(node: Node) -> bool:
    """Whether ``node`` is the backward of a custom ``autograd.Function`` (a compiled
    graph's ``CompiledFunctionBackward`` included): it returns every gradient it computes,
    whichever are asked for, so it runs once, at ``I``."""
    return isinstance(node, BackwardCFunction)


def checkpoints_itself(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> bool:
    """Whether the graph from ``inputs`` to ``outputs`` (a partition's forward pass) holds a
    region of torch's checkpoint (``torch.utils.checkpoint``, reentrant or not), which
    recomputes in the backward pass.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> x = torch.ones(2, requires_grad=True)
        >>> checkpoints_itself([checkpoint(torch.sin, x, use_reentrant=False)], [x])
        True
        >>> checkpoints_itself([torch.sin(x)], [x])
        False
    """
    stop = {tensor.grad_fn for tensor in inputs if tensor.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None and t.grad_fn not in stop]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if type(node).__name__ == "CheckpointFunctionBackward" or _checkpointed(node):
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen and child not in stop:
                seen.add(child)
                stack.append(child)
    return False


#: The names of each node type's saved tensors (``_raw_saved_*``), read once per type.
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _checkpointed(node: Node) -> bool:
    """Whether ``node`` saved a tensor through a non-reentrant ``torch.utils.checkpoint``:
    unpacking it in another backward call than ``I``'s would recompute the region."""
    if _HOLDER is None:
        return False
    kind = type(node)
    names = _SAVED_NAMES.get(kind)
    if names is None:
        names = _SAVED_NAMES[kind] = tuple(
            name for name in dir(node) if name.startswith("_raw_saved_")
        )
    for name in names:
        try:
            saved = getattr(node, name)
        except RuntimeError:  # freed, or not a tensor here
            continue
        for one in saved if isinstance(saved, list | tuple) else (saved,):
            if isinstance(getattr(one, "data", None), _HOLDER):
                return True
    return False


def _accumulate_grad() -> type:
    leaf = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        node = _node(leaf)
    return type(node)


#: The type of the nodes that accumulate a leaf's gradient (``AccumulateGrad``).
_ACCUMULATE_GRAD = _accumulate_grad()


def _is_leaf_node(node: Node) -> bool:
    return type(node) is _ACCUMULATE_GRAD


class _Graph:
    """The nodes reachable from ``roots`` (not past the wanted inputs' nodes): which lead to
    an input (the input path), which to a leaf off it."""

    def __init__(self, roots: Sequence[Node], inputs: dict[Node, int]) -> None:
        self.inputs = inputs
        self.to_input: dict[Node, bool] = {}
        self.to_leaf: dict[Node, bool] = {}
        #: Each node's ``next_functions`` (read once: each read builds new tuples).
        self.edges: dict[Node, tuple[tuple[Node | None, int], ...]] = {}
        #: The nodes of the input path (the inputs' own nodes excluded).
        self.path: list[Node] = []
        seen: set[Node] = set()
        stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
        while stack:
            node, done = stack.pop()
            if done:
                self._finish(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            if node in inputs:
                continue
            edges = self.edges[node] = node.next_functions
            stack.extend((child, False) for child, _ in edges if child is not None)

    def _finish(self, node: Node) -> None:
        if node in self.inputs:
            self.to_input[node], self.to_leaf[node] = True, False
            return
        children = [child for child, _ in self.edges[node] if child is not None]
        to_input = any(self.to_input[child] for child in children)
        self.to_input[node] = to_input
        self.to_leaf[node] = _is_leaf_node(node) or any(
            self.to_leaf[child] for child in children if child not in self.inputs
        )
        if to_input:
            self.path.append(node)

    def leafward(self, node: Node) -> bool:
        """Whether ``node`` is off the input path and leads to a leaf."""
        return not self.to_input.get(node, False) and self.to_leaf.get(node, False)


def _capture(captured: dict[Node, _Grads], node: Node) -> Callable[[Any], None]:
    def hook(grad_outputs: _Grads) -> None:
        captured[node] = tuple(grad_outputs)

    return hook


def _returned(returned: dict[Node, _Grads], node: Node) -> Callable[[Any, Any], None]:
    def hook(grad_inputs: _Grads, grad_outputs: _Grads) -> None:
        returned[node] = tuple(grad_inputs)

    return hook
