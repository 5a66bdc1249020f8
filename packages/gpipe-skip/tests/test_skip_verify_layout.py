"""verify_skippables, problem by problem, the skip layout of a split model, and run_partition."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpipe_skip import (
    DEFAULT_NAMESPACE,
    Namespace,
    SkipLayout,
    SkipRoute,
    SkipTracker,
    inspect_skip_layout,
    pop,
    run_partition,
    skippable,
    stash,
    verify_skippables,
)


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x + 1


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x + skip


def problems(module: nn.Sequential) -> list[str]:
    with pytest.raises(TypeError) as info:
        verify_skippables(module)
    message = str(info.value)
    head, *lines = message.split("\n")
    count = len(lines)
    assert head == (
        f"the skip connections of the module are inconsistent "
        f"({count} problem{'s' if count > 1 else ''}):"
    )
    assert all(line.startswith("  - ") for line in lines)
    return [line[4:] for line in lines]


def test_valid_modules_pass() -> None:
    verify_skippables(nn.Sequential())
    verify_skippables(nn.Sequential(nn.Linear(1, 1)))
    verify_skippables(nn.Sequential(Stash(), nn.ReLU(), Pop()))
    ns = Namespace()
    verify_skippables(
        nn.Sequential(Stash().isolate(ns), Stash(), Pop(), nn.ReLU(), Pop().isolate(ns))
    )


def test_pop_without_any_stash() -> None:
    assert problems(nn.Sequential(nn.ReLU(), Pop())) == [
        "layer 1 (Pop) pops 'skip' in <default namespace> but no layer stashes it"
    ]


def test_stash_never_popped() -> None:
    assert problems(nn.Sequential(Stash(), nn.ReLU())) == [
        "layer 0 (Stash) stashes 'skip' in <default namespace> but no later layer pops it"
    ]


def test_pop_before_its_stash() -> None:
    assert problems(nn.Sequential(Pop(), nn.ReLU(), Stash())) == [
        "layer 0 (Pop) pops 'skip' in <default namespace> before layer 2 stashes it"
    ]


def test_stashed_twice_in_one_namespace() -> None:
    assert problems(nn.Sequential(Stash(), Stash(), Pop())) == [
        "layer 1 (Stash) stashes 'skip' in <default namespace> again (layer 0 stashes it)"
    ]


def test_popped_twice_in_one_namespace() -> None:
    assert problems(nn.Sequential(Stash(), Pop(), Pop())) == [
        "layer 2 (Pop) pops 'skip' in <default namespace> again (layer 1 pops it)"
    ]


def test_the_same_layer_twice_stashes_twice() -> None:
    layer = Stash()
    assert problems(nn.Sequential(layer, layer, Pop())) == [
        "layer 1 (Stash) stashes 'skip' in <default namespace> again (layer 0 stashes it)"
    ]


def test_problems_name_their_namespace() -> None:
    ns = Namespace()
    found = problems(nn.Sequential(Stash().isolate(ns), Pop()))
    assert found == [
        f"layer 0 (Stash) stashes 'skip' in {ns!r} but no later layer pops it",
        "layer 1 (Pop) pops 'skip' in <default namespace> but no layer stashes it",
    ]
    assert re.fullmatch(r"<Namespace [0-9a-f]{8}>", repr(ns))


def test_every_problem_is_listed_at_once_in_layer_order() -> None:
    ns = Namespace()
    found = problems(
        nn.Sequential(
            Pop(),  # 0: before its stash (layer 1)
            Stash(),  # 1
            Stash(),  # 2: stashed again
            Pop().isolate(ns),  # 3: no stash in ns
            Stash().isolate(ns),  # 4: never popped after (the pop at 3 comes first)
            nn.ReLU(),
        )
    )
    assert found == [
        "layer 0 (Pop) pops 'skip' in <default namespace> before layer 1 stashes it",
        "layer 2 (Stash) stashes 'skip' in <default namespace> again (layer 1 stashes it)",
        f"layer 3 (Pop) pops 'skip' in {ns!r} before layer 4 stashes it",
    ]


def test_nested_skippable_is_a_problem() -> None:
    found = problems(nn.Sequential(nn.Sequential(Stash(), Pop())))
    assert found == [
        "layer 0 (Sequential) contains a skippable module at '0' (Stash); skippable modules "
        "must be layers of the sequential module itself",
        "layer 0 (Sequential) contains a skippable module at '1' (Pop); skippable modules "
        "must be layers of the sequential module itself",
    ]


class PairsItsOwn(nn.Sequential):
    """A container that keeps the layout of its own skips, as a nested GPipe does."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.skip_layout = inspect_skip_layout([self])


def test_a_module_with_its_own_skip_layout_pairs_its_own_skips() -> None:
    inner = PairsItsOwn(Stash(), nn.ReLU(), Pop())
    verify_skippables(nn.Sequential(nn.ReLU(), inner, nn.ReLU()))
    verify_skippables(nn.Sequential(nn.Sequential(inner)))
    # Without a layout of its own, a container is no such module.
    del inner.skip_layout
    assert len(problems(nn.Sequential(inner))) == 2


def test_a_module_pairs_its_own_skips_whatever_it_calls_its_layout() -> None:
    # gpipe_skip recognises a module by the SkipLayout it keeps, not by an attribute name.
    inner = nn.Sequential(Stash(), nn.ReLU(), Pop())
    inner.routing = inspect_skip_layout([inner])
    verify_skippables(nn.Sequential(nn.ReLU(), inner, nn.ReLU()))
    assert inspect_skip_layout([nn.Sequential(inner), nn.Sequential(nn.ReLU())]).routes == ()
    # Something else under the name a pipeline uses does not count.
    other = nn.Sequential(Stash(), Pop())
    other.skip_layout = "not a layout"
    assert len(problems(nn.Sequential(other))) == 2


def test_verify_needs_a_sequential() -> None:
    with pytest.raises(TypeError, match=r"module must be nn.Sequential .* \(module: Linear\)"):
        verify_skippables(nn.Linear(1, 1))  # type: ignore[arg-type]


def long_skip_model() -> nn.Sequential:
    return nn.Sequential(Stash(), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU(), Pop())


def test_layout_of_a_long_skip() -> None:
    model = long_skip_model()
    layout = inspect_skip_layout([model[0:2], model[2:3], model[3:5], model[5:]])
    assert isinstance(layout, SkipLayout)
    route = SkipRoute(DEFAULT_NAMESPACE, "skip", 0, 3, 0, 5)
    assert layout.routes == (route,)
    assert layout.crossing() == [route]
    assert route.crosses and route.key == (DEFAULT_NAMESPACE, "skip")
    assert layout.provides(0) == [route] and layout.requires(3) == [route]
    for j in (1, 2):
        assert layout.provides(j) == [] and layout.requires(j) == []
    assert [layout.has_skippables(j) for j in range(4)] == [True, False, False, True]
    assert not layout.empty and layout.partitions == 4
    assert repr(layout) == (
        "SkipLayout(4 partitions, 1 skip)\n"
        "  'skip' in <default namespace>: partition 0 (layer 0) -> partition 3 (layer 5)"
    )


def test_layout_of_a_skip_inside_one_partition() -> None:
    model = nn.Sequential(nn.ReLU(), Stash(), nn.ReLU(), Pop(), nn.ReLU())
    layout = inspect_skip_layout([model[:1], model[1:4], model[4:]])
    assert layout.crossing() == [] and len(layout.routes) == 1
    assert [layout.has_skippables(j) for j in range(3)] == [False, True, False]
    model = long_skip_model()
    layout = inspect_skip_layout([model])
    assert layout.crossing() == [] and layout.requires(0) == [] and layout.provides(0) == []
    assert str(layout.routes[0]).endswith("partition 0 (layer 5), inside one partition")


def test_layout_without_skippables_is_empty() -> None:
    layout = inspect_skip_layout([nn.Sequential(nn.ReLU()), nn.Sequential(nn.ReLU())])
    assert (
        layout.empty and layout.routes == () and repr(layout) == "SkipLayout(2 partitions, 0 skips)"
    )


def test_layout_errors() -> None:
    with pytest.raises(
        TypeError, match=r"every partition must be nn.Sequential \(partition 1: ReLU"
    ):
        inspect_skip_layout([nn.Sequential(), nn.ReLU()])  # type: ignore[list-item]
    model = nn.Sequential(Pop(), Stash())
    with pytest.raises(
        TypeError, match=r"layer 0 \(Pop\) pops 'skip' in <default namespace> before"
    ):
        inspect_skip_layout([model[:1], model[1:]])


def test_run_partition_makes_skips_explicit() -> None:
    model = long_skip_model()
    key = (DEFAULT_NAMESPACE, "skip")
    x = torch.ones(2)
    output, out = run_partition(model[:2], x)
    assert list(out) == [key] and out[key] is x
    torch.testing.assert_close(output, torch.full((2,), 2.0))
    output, out = run_partition(model[2:5], output)
    assert out == {}
    output, out = run_partition(model[5:], output, {key: torch.full((2,), 10.0)})
    assert out == {}
    torch.testing.assert_close(output, torch.full((2,), 12.0))
    # Inside one partition, the popped tensor is the stashed one: no copy.
    seen: list[torch.Tensor] = []

    @skippable(pop=["skip"])
    class Spy(nn.Module):
        def forward(self, x):
            seen.append((yield pop("skip")))
            return x

    run_partition(nn.Sequential(Stash(), Spy()), x)
    assert seen[0] is x


def test_run_partition_passes_none_skips() -> None:
    @skippable(pop=["skip"])
    class MaybePop(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return x if skip is None else x + skip

    output, _ = run_partition(MaybePop(), torch.ones(1), {(DEFAULT_NAMESPACE, "skip"): None})
    torch.testing.assert_close(output, torch.ones(1))


def test_tracker_pop_of_a_missing_key() -> None:
    tracker = SkipTracker({(DEFAULT_NAMESPACE, "a"): None})
    with pytest.raises(
        LookupError,
        match=r"no skip tensor is stashed under 'b' in <default namespace>: .*\(stashed: \['a'\]\)",
    ):
        tracker.pop((DEFAULT_NAMESPACE, "b"))
    assert (DEFAULT_NAMESPACE, "a") in tracker and repr(tracker) == "SkipTracker(stashed=['a'])"
    assert tracker.pop((DEFAULT_NAMESPACE, "a")) is None and len(tracker) == 0


STASH_CLASSES = {
    name: skippable(stash=[name])(type(f"Stash_{name}", (nn.Identity,), {})) for name in "ab"
}
POP_CLASSES = {
    name: skippable(pop=[name])(type(f"Pop_{name}", (nn.Identity,), {})) for name in "ab"
}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["stash", "pop"]), st.sampled_from("ab"), st.integers(0, 1)),
        max_size=7,
    )
)
def test_verify_accepts_exactly_the_valid_layouts(layers: list[tuple[str, str, int]]) -> None:
    namespaces = [DEFAULT_NAMESPACE, Namespace()]
    modules = []
    for verb, name, ns in layers:
        cls = STASH_CLASSES[name] if verb == "stash" else POP_CLASSES[name]
        modules.append(cls().isolate(namespaces[ns]))
    # The reference: per (namespace, name), exactly one stash followed by exactly one pop.
    events: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for index, (verb, name, ns) in enumerate(layers):
        events.setdefault((ns, name), []).append((index, verb))
    valid = all([verb for _, verb in seq] == ["stash", "pop"] for seq in events.values())
    model = nn.Sequential(*modules)
    if valid:
        verify_skippables(model)
        layout = inspect_skip_layout([model])
        assert len(layout.routes) == len(events)
        return
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    lines = str(info.value).split("\n")[1:]
    assert lines
    for line in lines:
        index = int(re.match(r"  - layer (\d+) ", line).group(1))  # type: ignore[union-attr]
        verb, name, ns = layers[index]
        assert f"'{name}' in {namespaces[ns]!r}" in line
        assert f"{verb}es " in line if verb == "stash" else "pops " in line
