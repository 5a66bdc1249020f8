"""The backward pass split in two: the input gradient now, the weight gradient later.

A zero-bubble schedule runs a micro-batch's backward pass in two actions (see
:mod:`gpipe_core._schedule`): the input gradient ``I`` (sent upstream at once) and the
weight gradient ``W`` (deferred). :meth:`SplitBackward.input_gradient` runs ``I`` and
returns the :class:`WeightGradient` that runs ``W``; together they compute what one
backward pass does, and each node of the autograd graph runs once.

**How the graph is cut.** From the roots (the outputs that received a gradient, the loss),
the *input path* is every node from which one of the wanted inputs can be reached. ``I``
runs the input path only: autograd computes only the outputs of a node that lead to the
inputs (a linear layer's ``AddmmBackward`` computes its input's gradient, not its weight's).
The nodes of the input path that also lead to leaves off it (parameters) are the *frontier*:
a pre-hook captures the gradient flowing into each during ``I``. ``W`` runs each frontier
node again from that gradient, for its edges off the input path only, down to the leaves
(its weight's ``mm``, then ``AccumulateGrad``), and nothing of the input path (a test counts
a custom function's backward calls on it: one per micro-batch). The roots off the input
path (a loss where no input needs a gradient, an output computed from parameters only) are
differentiated whole by ``W``.

``W`` runs one autograd call per *group*: frontier nodes whose parts below the input path
share a node (a parameter used by two layers) go together, and autograd then runs the
input path between them again (exact; the repetition is limited to such layers). Other
groups share no node, and their calls touch no node of the input path but their own
frontier node. During ``W`` a pre-hook sets each frontier node's gradient to what ``I``
captured: what the input path sends it again is dropped, and so is the effect of a hook on
the tensor it differentiates (``Tensor.register_hook``), which ran at ``I`` already (the
hook is called again, its result is not used).

**Backward passes that cannot be split.** The backward of a custom ``autograd.Function``
returns every gradient it computes, whichever are asked for; a compiled graph's
(``CompiledFunctionBackward``: a partition or layer compiled by ``torch.compile`` with
``aot_eager`` or ``inductor``) is one such function. Such a node on the frontier runs
whole, once, at ``I``: the gradients into its children off the input path are captured
then, and ``W`` starts from them (set back to them, as a frontier node's). Where every
frontier node is such (a partition compiled whole), :attr:`SplitBackward.whole` says so:
the partition runs its whole backward pass at ``I`` (a backward task on the timeline) and
its ``W`` is empty. A layer compiled with ``backend="eager"`` records the usual nodes and
splits as usual. So does ``torch.utils.checkpoint`` with ``use_reentrant=False``; with
``use_reentrant=True`` its backward refuses to run for chosen inputs only, so a partition
with one runs its whole backward pass at ``I`` as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from gpipe_checkpoint import gradients, run_backward

__all__ = ["SplitBackward", "WeightGradient"]


_Grads = tuple[Tensor | None, ...]


class _Group:
    """One autograd call of a weight gradient: seeds (frontier nodes' edges with their
    captured gradients, or roots with theirs) down to the group's leaves."""

    __slots__ = ("clamped", "grads", "leaves", "seeds")

    def __init__(self) -> None:
        self.seeds: list[Tensor | GradientEdge] = []
        self.grads: list[Tensor] = []
        #: The leaves (parameters) the group's part of the graph reaches.
        self.leaves: list[Tensor] = []
        #: The nodes whose gradient is set back to the one captured at ``I`` (frontier
        #: nodes, and the children of those that do not split), by position.
        self.clamped: list[tuple[Node, dict[int, Tensor | None]]] = []

    def run(self) -> None:
        if not self.seeds or not self.leaves:
            return
        handles = [node.register_prehook(_replace(grads)) for node, grads in self.clamped]
        try:
            # Tensors and edges mixed, as autograd takes them. The graph is kept: another
            # group's call may run this group's frontier node on its way (the graph is
            # freed with the weight gradient).
            run_backward(self.seeds, self.grads, inputs=self.leaves, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()


class WeightGradient:
    """The weight gradient of one micro-batch, made by :meth:`SplitBackward.input_gradient`:
    calling it accumulates the leaves' gradients (into ``.grad``) and frees the graph."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups

    def __call__(self) -> None:
        groups, self.groups = self.groups, []
        for group in groups:
            group.run()


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
        #: The frontier nodes that split, with their children off the input path.
        self.frontier: list[tuple[Node, list[Node]]] = []
        #: The edges off the input path of the frontier nodes that do not split.
        self.captures: list[GradientEdge] = []
        #: Whether the input path has a reentrant checkpoint (``torch.utils.checkpoint``
        #: with ``use_reentrant=True``), which refuses a backward pass to chosen inputs.
        self.reentrant = False
        for node in graph.path:
            if type(node).__name__ == "CheckpointFunctionBackward":
                self.reentrant = True
            edges = graph.edges[node]
            off = [
                child
                for child, _ in edges
                if child is not None and child not in self.inputs and graph.leafward(child)
            ]
            if not off:
                continue
            if _unsplittable(node):
                self.captures.extend(
                    GradientEdge(child, nr)
                    for child, nr in edges
                    if child is not None and child in off
                )
            else:
                self.frontier.append((node, off))
        #: The roots that lead to an input (or are one), and those off the input path
        #: that lead to a leaf (differentiated whole by the weight gradient).
        self.on_path = [k for k, node in enumerate(self.nodes) if graph.to_input.get(node, False)]
        self.off_path = [
            k
            for k, node in enumerate(self.nodes)
            if not graph.to_input.get(node, False) and graph.leafward(node)
        ]

    @property
    def whole(self) -> bool:
        """Whether the backward pass runs whole, at the input gradient: nothing of the
        parameters' side can wait for a weight gradient (every frontier node's backward
        computes all of its gradients at once: a compiled partition's), or the input path
        has a reentrant checkpoint."""
        return self.reentrant or (bool(self.captures) and not self.frontier and not self.off_path)

    def input_gradient(self) -> tuple[list[Tensor | None], WeightGradient]:
        """Differentiate the roots to ``wanted`` only.

        Returns:
            The gradient of each of ``wanted`` (None where none flowed), and what the
            weight gradient runs later (see the module's docstring).
        """
        roots, seeds, wanted, captures = self.roots, self.seeds, self.wanted, self.captures
        captured: dict[Node, _Grads] = {}
        grads: list[Tensor | None] = [None] * len(wanted)
        edge_grads: Sequence[Tensor | None] = []
        if self.on_path and (wanted or captures):
            hooks = [node.register_prehook(_capture(captured, node)) for node, _ in self.frontier]
            try:
                found = gradients(
                    [roots[k] for k in self.on_path],
                    [seeds[k] for k in self.on_path],
                    [*wanted, *captures],
                    retain_graph=True,
                )
            finally:
                for hook in hooks:
                    hook.remove()
            grads = list(found[: len(wanted)])
            edge_grads = found[len(wanted) :]
        # The weight gradient's seeds, grouped by the parts of the graph they reach.
        groups = _Groups()
        for node, off in self.frontier:
            if node in captured:
                groups.add_frontier(node, captured[node], off)
        for edge, grad in zip(captures, edge_grads, strict=True):
            if grad is not None:
                groups.add_captured(edge, grad)
        for k in self.off_path:
            groups.add(roots[k], seeds[k], self.nodes[k])
        return grads, WeightGradient(groups.made())


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


class _Groups:
    """The seeds of a weight gradient, grouped where their parts of the graph meet."""

    def __init__(self) -> None:
        self.owner: dict[Node, int] = {}  # a node off the input path -> its seed's index
        self.parent: list[int] = []
        self.seeds: list[tuple[Tensor | GradientEdge, Tensor]] = []
        #: What each group's nodes are set back to, by a seed's index.
        self.clamps: dict[int, tuple[Node, dict[int, Tensor | None]]] = {}

    def _find(self, k: int) -> int:
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def _claim(self, k: int, starts: Sequence[Node]) -> None:
        """Own the nodes reachable from ``starts``, joining the groups met on the way."""
        stack = list(starts)
        while stack:
            node = stack.pop()
            owner = self.owner.get(node)
            if owner is not None:
                a, b = self._find(owner), self._find(k)
                if a != b:
                    self.parent[a] = b
                continue
            self.owner[node] = k
            stack.extend(child for child, _ in node.next_functions if child is not None)

    def _new(self, seed: Tensor | GradientEdge, grad: Tensor) -> int:
        k = len(self.seeds)
        self.seeds.append((seed, grad))
        self.parent.append(k)
        return k

    def add(self, seed: Tensor | GradientEdge, grad: Tensor, node: Node) -> None:
        """A seed (a root, or an edge), whose gradient flows into ``node``."""
        self._claim(self._new(seed, grad), [node])

    def add_captured(self, edge: GradientEdge, grad: Tensor) -> None:
        """An edge of a frontier node that does not split, with the gradient captured
        into it at ``I`` (all that flowed there then: set back to it at ``W``)."""
        k = self._new(edge, grad)
        self.clamps[k] = (edge.node, {edge.output_nr: grad})
        self._claim(k, [edge.node])

    def add_frontier(self, node: Node, grads: _Grads, off: Sequence[Node]) -> None:
        """A frontier node with the gradient captured into it, and its children off the
        input path (its seeds: one per output that received a gradient, in one group)."""
        made = [
            self._new(GradientEdge(node, nr), grad)
            for nr, grad in enumerate(grads)
            if grad is not None
        ]
        if not made:
            return
        k = made[-1]
        for j in made[:-1]:
            self.parent[j] = k
        self.clamps[k] = (node, dict(enumerate(grads)))
        self._claim(k, off)

    def made(self) -> list[_Group]:
        groups: dict[int, _Group] = {}
        for k, (seed, grad) in enumerate(self.seeds):
            root = self._find(k)
            group = groups.setdefault(root, _Group())
            group.seeds.append(seed)
            group.grads.append(grad)
        for k, (node, grads) in self.clamps.items():
            groups[self._find(k)].clamped.append((node, grads))
        for node, k in self.owner.items():
            if _is_leaf_node(node):
                groups[self._find(k)].leaves.append(node.variable)  # type: ignore[attr-defined]
        return list(groups.values())


def _capture(captured: dict[Node, _Grads], node: Node) -> Callable[[Any], None]:
    def hook(grad_outputs: _Grads) -> None:
        captured[node] = tuple(grad_outputs)

    return hook


def _replace(grads: dict[int, Tensor | None]) -> Callable[[Any], _Grads]:
    def hook(grad_outputs: _Grads) -> _Grads:
        return tuple(grads.get(nr, grad) for nr, grad in enumerate(grad_outputs))

    return hook
