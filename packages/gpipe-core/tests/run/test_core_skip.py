"""Skip connections through GPipe: the same outputs and gradients as the plain model.

A U-Net-style model (encoder/decoder pairs sharing one skip name, each pair in its own
namespace) is compared with the plain nn.Sequential over random depths, balances, chunk
counts and checkpoint modes; then the shapes a property would rarely draw: several
stashes and pops in one layer, isolate(only=...), conditional (None) skips, tuples and
integer tensors, one tensor stashed twice, eval mode and no_grad.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from core_support.checks import assert_matches_plain
from core_support.models import MODES, MaybePop, MaybeStash, unet_layers
from core_support.strategies import compositions
from gpipe_core import GPipe
from gpipe_skip import (
    Namespace,
    current_skip_tracker,
    inspect_skip_layout,
    pop,
    skippable,
    stash,
)


def unet(depth: int, width: int, seed: int) -> nn.Sequential:
    """``depth`` encoder/decoder pairs, every pair in its own namespace, sharing 'skip'."""
    torch.manual_seed(seed)
    return nn.Sequential(*unet_layers(depth, width), nn.Linear(width, 2)).double()


@dataclass(frozen=True)
class Spec:
    depth: int
    balance: tuple[int, ...]
    chunks: int
    batch: int
    checkpoint: str
    input_requires_grad: bool
    seed: int


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    depth = draw(st.integers(3, 4))
    layers = 2 * depth + 2
    parts = draw(st.integers(1, 4))
    balance = draw(st.sampled_from(compositions(layers, parts)))
    return Spec(
        depth=depth,
        balance=tuple(balance),
        chunks=draw(st.integers(1, 4)),
        batch=draw(st.integers(1, 8)),
        checkpoint=draw(st.sampled_from(MODES)),
        input_requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def run_unet(spec: Spec) -> None:
    model = unet(spec.depth, 3, spec.seed)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)
    torch.manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, 3, dtype=torch.float64)
    assert_matches_plain(
        pipe, plain, x, input_requires_grad=spec.input_requires_grad, weighted=True
    )
    assert len(current_skip_tracker()) == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_unet_equivalence(spec: Spec) -> None:
    run_unet(spec)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize(
    "balance",
    [
        [8],  # every skip inside one partition
        [1, 1, 1, 1, 1, 1, 1, 1],  # every skip crosses partitions
        [3, 1, 3, 1],  # encoders together, decoders together
        [2, 4, 2],  # the innermost pair inside the middle partition
        [1, 5, 2],  # the outermost skip jumps over the middle partition
    ],
)
def test_unet_fixed_balances(balance: list[int], checkpoint: str) -> None:
    spec = Spec(3, tuple(balance), 3, 7, checkpoint, True, 0)
    run_unet(spec)


def test_unet_layout() -> None:
    pipe = GPipe(unet(3, 3, 0), [1, 5, 2])
    crossing = pipe.skip_layout.crossing()
    assert [(r.stash_partition, r.pop_partition, r.stash_layer, r.pop_layer) for r in crossing] == [
        (0, 2, 0, 6)
    ]
    assert len(pipe.skip_layout.routes) == 3
    assert "partition 0 (layer 0) -> partition 2 (layer 6)" in repr(pipe.skip_layout)
    # The same report from the wrapped module's partitions.
    assert inspect_skip_layout(pipe.partitions).routes == pipe.skip_layout.routes


@skippable(stash=["carol"])
class StashCarol(nn.Module):
    def forward(self, x):
        yield stash("carol", x * 3)
        return x + 1


@skippable(stash=["alice", "bob"], pop=["carol"])
class StashStashPop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        yield stash("alice", torch.tanh(self.linear(x)))
        yield stash("bob", x * 2)
        carol = yield pop("carol")
        return x * carol


@skippable(pop=["alice", "bob"])
class PopPop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        alice = yield pop("alice")
        bob = yield pop("bob")
        return self.linear(x) + alice * bob


def several_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        StashCarol(), nn.Linear(3, 3), StashStashPop(), nn.Tanh(), nn.Linear(3, 3), PopPop()
    ).double()


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[6], [1, 5], [2, 1, 3], [3, 2, 1], [1, 1, 1, 3]])
def test_several_stashes_and_pops_in_one_layer(balance: list[int], checkpoint: str) -> None:
    model = several_model()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(5, 3, dtype=torch.float64), weighted=True)


@pytest.mark.parametrize("checkpoint", MODES)
def test_isolate_only(checkpoint: str) -> None:
    torch.manual_seed(0)
    ns_alice, ns_bob = Namespace(), Namespace()

    def pair() -> list[nn.Module]:
        return [
            StashCarol(),
            StashStashPop().isolate(ns_alice, only=["alice"]).isolate(ns_bob, only=["bob"]),
            nn.Tanh(),
            # Its own "alice" and "bob" in the default namespace: no clash with the first.
            StashStashPop().isolate(Namespace(), only=["carol"]),
            PopPop(),
            nn.Linear(3, 3),
        ]

    stashes_carol = StashCarol().isolate(Namespace())
    layers = pair()
    # The second StashStashPop pops "carol" from its own namespace: give it a stash there.
    second = layers[3]
    assert isinstance(second, StashStashPop)
    stashes_carol.isolate(second.namespace_of("carol"))
    layers.insert(3, stashes_carol)
    layers.append(PopPop().isolate(ns_alice, only=["alice"]).isolate(ns_bob, only=["bob"]))
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2, 2, 2], chunks=2, checkpoint=checkpoint)
    assert len(pipe.skip_layout.routes) == 6
    assert_matches_plain(pipe, plain, torch.randn(4, 3, dtype=torch.float64), weighted=True)


@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[4], [1, 3], [1, 2, 1]])
def test_conditional_skip(balance: list[int], checkpoint: str, active: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MaybeStash(), nn.Linear(3, 3), nn.Tanh(), MaybePop()).double()
    model[0].active = active
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(6, 3, dtype=torch.float64), weighted=True)


@skippable(stash=["x", "ids"])
class StashPair(nn.Module):
    def forward(self, pair):
        x, ids = pair
        yield stash("x", x)
        yield stash("ids", ids)
        return x * 2, ids + 1


class Pass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, pair):
        x, ids = pair
        return torch.tanh(self.linear(x)), ids


@skippable(pop=["x", "ids"])
class PopPair(nn.Module):
    def forward(self, pair):
        x, ids = pair
        skip = yield pop("x")
        old_ids = yield pop("ids")
        return x + skip * (ids - old_ids).unsqueeze(1).to(x.dtype)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[3], [1, 1, 1], [2, 1]])
def test_tuples_and_integer_skips(balance: list[int], checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(StashPair(), Pass(), PopPair()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=2, checkpoint=checkpoint)
    ids = torch.arange(4)
    assert_matches_plain(
        pipe, plain, torch.randn(4, 3, dtype=torch.float64), feed=lambda x: (x, ids)
    )


@skippable(stash=["a", "b"])
class StashTwice(nn.Module):
    def forward(self, x):
        yield stash("a", x)
        yield stash("b", x)
        return x * 3


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x):
        return x * (yield pop("a"))


@skippable(pop=["b"])
class PopB(nn.Module):
    def forward(self, x):
        return x + (yield pop("b"))


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[4], [1, 3], [1, 1, 2], [2, 1, 1], [1, 2, 1]])
def test_one_tensor_stashed_twice(balance: list[int], checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(StashTwice(), nn.Linear(3, 3), PopA(), PopB()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=2, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(4, 3, dtype=torch.float64), weighted=True)


@pytest.mark.parametrize("balance", [[8], [1, 5, 2], [2, 2, 2, 2]])
def test_eval_mode_and_no_grad(balance: list[int]) -> None:
    model = unet(3, 3, 0)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3)
    x = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    pipe.eval()
    plain.eval()
    torch.testing.assert_close(pipe(x), plain(x))
    assert len(current_skip_tracker()) == 0


class Node(nn.Module):
    """A layer of a random skip graph: pops its names, stashes its names (maybe None)."""

    def __init__(self, width: int, none: tuple[str, ...]) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.none = none

    def forward(self, x):
        for name in self.pop_names:  # type: ignore[attr-defined]
            skip = yield pop(name)
            if skip is not None:
                x = x + skip
        hidden = torch.tanh(self.linear(x))
        for index, name in enumerate(self.stash_names):  # type: ignore[attr-defined]
            yield stash(name, None if name in self.none else hidden * (index + 1))
        return hidden


@dataclass(frozen=True)
class GraphSpec:
    layers: int
    pairs: tuple[tuple[int, int], ...]  # (stashing layer, popping layer) per skip name
    none: frozenset[int]  # the skips that stash None
    balance: tuple[int, ...]
    chunks: int
    checkpoint: str
    seed: int


@st.composite
def graph_specs(draw: st.DrawFn) -> GraphSpec:
    layers = draw(st.integers(2, 7))
    pair = st.tuples(st.integers(0, layers - 2), st.integers(1, layers - 1)).filter(
        lambda p: p[0] < p[1]
    )
    pairs = tuple(draw(st.lists(pair, min_size=1, max_size=4)))
    none = frozenset(draw(st.sets(st.integers(0, len(pairs) - 1), max_size=1)))
    parts = draw(st.integers(1, min(4, layers)))
    return GraphSpec(
        layers=layers,
        pairs=pairs,
        none=none,
        balance=tuple(draw(st.sampled_from(compositions(layers, parts)))),
        chunks=draw(st.integers(1, 3)),
        checkpoint=draw(st.sampled_from(MODES)),
        seed=draw(st.integers(0, 2**16)),
    )


def graph_model(spec: GraphSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)
    layers = []
    for index in range(spec.layers):
        stashes = [f"s{k}" for k, (a, _) in enumerate(spec.pairs) if a == index]
        pops = [f"s{k}" for k, (_, b) in enumerate(spec.pairs) if b == index]
        none = tuple(f"s{k}" for k in spec.none)
        layers.append(skippable(stash=stashes, pop=pops)(Node)(3, none))
    return nn.Sequential(*layers).double()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=graph_specs())
def test_random_skip_graphs(spec: GraphSpec) -> None:
    model = graph_model(spec)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, list(spec.balance), chunks=spec.chunks, checkpoint=spec.checkpoint)
    crossing = pipe.skip_layout.crossing()
    owner = [j for j, count in enumerate(spec.balance) for _ in range(count)]
    assert len(crossing) == sum(1 for a, b in spec.pairs if owner[a] != owner[b])
    assert_matches_plain(pipe, plain, torch.randn(5, 3, dtype=torch.float64), weighted=True)


@skippable(stash=["out"])
class StashOutput(nn.Module):
    """Stashes the very tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        hidden = torch.tanh(self.linear(x))
        yield stash("out", hidden)
        return hidden


@skippable(stash=["detached"])
class StashDetached(nn.Module):
    """Stashes a tensor that needs no gradient."""

    def forward(self, x):
        yield stash("detached", x.detach() * 2)
        return x


@skippable(pop=["out", "detached"])
class PopBoth(nn.Module):
    def forward(self, x):
        out = yield pop("out")
        detached = yield pop("detached")
        return x * out + detached


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[4], [1, 1, 1, 1], [2, 2], [1, 3]])
def test_stashing_the_output_itself_and_a_detached_tensor(
    balance: list[int], checkpoint: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(StashOutput(), StashDetached(), nn.Linear(3, 3), PopBoth()).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    assert_matches_plain(pipe, plain, torch.randn(6, 3, dtype=torch.float64), weighted=True)


@pytest.mark.parametrize("inner_checkpoint", MODES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_a_nested_gpipe_pairs_its_own_skips(checkpoint: str, inner_checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), unet(3, 3, 0), nn.Linear(2, 3)).double()
    plain = copy.deepcopy(model)
    model[1] = GPipe(model[1], [3, 3, 2], chunks=2, checkpoint=inner_checkpoint)
    # The outer GPipe leaves the inner one's skips to it: no skip crosses its partitions.
    pipe = GPipe(model, [1, 1, 1], chunks=2, checkpoint=checkpoint)
    assert pipe.skip_layout.empty
    assert_matches_plain(pipe, plain, torch.randn(4, 3, dtype=torch.float64), weighted=True)
