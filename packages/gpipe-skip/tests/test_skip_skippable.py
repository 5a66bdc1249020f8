"""Skippable layers on their own: the decorator, stash and pop, namespaces, the driver's errors.

Nothing here imports gpipe-core: skippable layers work in a plain nn.Sequential.
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading

import pytest
import torch
from torch import nn

from gpipe_checkpoint import checkpoint
from gpipe_skip import (
    DEFAULT_NAMESPACE,
    Namespace,
    Skippable,
    SkipTracker,
    current_skip_tracker,
    pop,
    skippable,
    stash,
    use_skip_tracker,
)


@skippable(stash=["skip"])
class Save(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        yield stash("skip", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["skip"])
class Add(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) + skip


@skippable(stash=["alice", "bob"], pop=["carol"])
class StashStashPop(nn.Module):
    def forward(self, x):
        yield stash("alice", x * 2)
        yield stash("bob", x * 3)
        carol = yield pop("carol")
        return x + carol


@skippable(stash=["carol"])
class StashCarol(nn.Module):
    def forward(self, x):
        yield stash("carol", x + 100)
        return x


@skippable(pop=["alice", "bob"])
class PopPop(nn.Module):
    def forward(self, x):
        alice = yield pop("alice")
        bob = yield pop("bob")
        return x + alice * 10 + bob * 100


@pytest.fixture(autouse=True)
def empty_default_tracker():
    """Each test starts and ends with nothing stashed in this thread's default tracker."""
    current_skip_tracker().clear()
    yield
    assert len(current_skip_tracker()) == 0
    current_skip_tracker().clear()


def reference(save: Save, add: Add, middle: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return add.linear(middle(torch.tanh(save.linear(x)))) + x


def test_plain_sequential_matches_hand_written_skip() -> None:
    torch.manual_seed(0)
    save, middle, add = Save(), nn.Linear(3, 3), Add()
    model = nn.Sequential(save, middle, add)
    x = torch.randn(5, 3, requires_grad=True)
    out = model(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    x_grad = x.grad.clone()

    for p in model.parameters():
        p.grad = None
    x2 = x.detach().clone().requires_grad_()
    expected = reference(save, add, middle, x2)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x_grad, x2.grad)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)


def test_decorated_class_keeps_name_parameters_and_state_dict() -> None:
    layer = Save()
    assert isinstance(layer, Skippable)
    assert type(layer).__name__ == "Save"
    assert type(layer).__qualname__ == "Save"
    assert list(layer.state_dict()) == ["linear.weight", "linear.bias"]
    assert Save.stash_names == ("skip",) and Save.pop_names == ()
    assert Add.pop_names == ("skip",) and Add.stash_names == ()


def test_skippable_as_a_function() -> None:
    class Plain(nn.Module):
        def forward(self, x):
            yield stash("x", x)
            return x

    Made = skippable(stash=["x"])(Plain)
    assert issubclass(Made, Plain) and issubclass(Made, Skippable)
    with use_skip_tracker(SkipTracker()) as tracker:
        Made()(torch.ones(1))
    assert list(tracker) == [(DEFAULT_NAMESPACE, "x")]


def test_several_stashes_and_pops_in_one_layer() -> None:
    model = nn.Sequential(StashCarol(), StashStashPop(), nn.Identity(), PopPop())
    x = torch.arange(3.0)
    # carol = x + 100; y = x + carol; out = y + 20 * x + 300 * x
    expected = (x + x + 100) + 20 * x + 300 * x
    torch.testing.assert_close(model(x), expected)


def test_isolate_all_names_lets_pairs_share_a_name() -> None:
    torch.manual_seed(0)
    ns1, ns2 = Namespace(), Namespace()
    s1, s2, a2, a1 = (
        Save().isolate(ns1),
        Save().isolate(ns2),
        Add().isolate(ns2),
        Add().isolate(ns1),
    )
    model = nn.Sequential(s1, s2, a2, a1)
    x = torch.randn(2, 3)
    h1 = torch.tanh(s1.linear(x))
    h2 = torch.tanh(s2.linear(h1))
    h3 = a2.linear(h2) + h1
    expected = a1.linear(h3) + x
    torch.testing.assert_close(model(x), expected)


def test_isolate_only_some_names_and_chaining() -> None:
    ns_alice, ns_bob = Namespace(), Namespace()
    first = StashStashPop()
    assert first.isolate(ns_alice, only=["alice"]).isolate(ns_bob, only=["bob"]) is first
    assert first.namespace_of("alice") == ns_alice
    assert first.namespace_of("bob") == ns_bob
    assert first.namespace_of("carol") == DEFAULT_NAMESPACE
    last = PopPop().isolate(ns_alice, only=["alice"])
    # "bob" of the last layer stays in the default namespace: the pop finds nothing there.
    model = nn.Sequential(StashCarol(), first, last)
    with pytest.raises(
        LookupError, match=r"^PopPop: no skip tensor is stashed under 'bob' in <default"
    ):
        model(torch.zeros(1))
    current_skip_tracker().clear()
    last.isolate(ns_bob, only=["bob"])
    torch.testing.assert_close(model(torch.ones(1)), torch.tensor([1.0 + 101 + 20 + 300]))


def test_isolate_errors() -> None:
    layer = StashStashPop()
    with pytest.raises(TypeError, match=r"ns must be a Namespace \(ns: str\)"):
        layer.isolate("ns")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"only must be a list of skip names, not a string"):
        layer.isolate(Namespace(), only="alice")
    with pytest.raises(
        ValueError,
        match=r"only names skips that StashStashPop does not declare \(only: \['dave'\], "
        r"declared: \['alice', 'bob', 'carol'\]\)",
    ):
        layer.isolate(Namespace(), only=["dave"])
    assert layer.namespace_of("alice") == DEFAULT_NAMESPACE


def test_conditional_skip_stashes_none() -> None:
    @skippable(stash=["maybe"])
    class MaybeStash(nn.Module):
        def forward(self, x):
            yield stash("maybe", x if x.sum() > 0 else None)
            return x

    @skippable(pop=["maybe"])
    class MaybePop(nn.Module):
        def forward(self, x):
            skip = yield pop("maybe")
            return x if skip is None else x + skip

    model = nn.Sequential(MaybeStash(), MaybePop())
    torch.testing.assert_close(model(torch.ones(2)), torch.full((2,), 2.0))
    torch.testing.assert_close(model(-torch.ones(2)), -torch.ones(2))


def test_undeclared_name_is_a_clear_error() -> None:
    @skippable(stash=["declared"])
    class Sloppy(nn.Module):
        def forward(self, x):
            yield stash("other", x)
            return x

    with pytest.raises(
        RuntimeError,
        match=r"the forward of Sloppy yielded stash\('other'\) but Sloppy does not declare "
        r"it \(@skippable\(stash=\['declared'\]\)\)",
    ):
        Sloppy()(torch.zeros(1))

    @skippable(stash=["x"])
    class PopsUndeclared(nn.Module):
        def forward(self, x):
            yield stash("x", x)
            yield pop("y")
            return x

    with pytest.raises(RuntimeError, match=r"yielded pop\('y'\) but PopsUndeclared does not"):
        PopsUndeclared()(torch.zeros(1))
    current_skip_tracker().clear()


def test_a_name_yielded_twice_is_an_error() -> None:
    @skippable(stash=["x"])
    class Twice(nn.Module):
        def forward(self, x):
            yield stash("x", x)
            yield stash("x", x)
            return x

    with pytest.raises(RuntimeError, match=r"the forward of Twice yielded stash\('x'\) twice"):
        Twice()(torch.zeros(1))
    current_skip_tracker().clear()


def test_a_declared_name_not_yielded_is_an_error() -> None:
    @skippable(stash=["x"], pop=["y"])
    class Forgets(nn.Module):
        def forward(self, x):
            return x
            yield  # a generator that yields nothing

    with pytest.raises(
        RuntimeError,
        match=r"the forward of Forgets returned without yielding stash\('x'\), pop\('y'\)",
    ):
        Forgets()(torch.zeros(1))

    @skippable(stash=["x"])
    class NotAGenerator(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(RuntimeError, match=r"NotAGenerator returned without yielding"):
        NotAGenerator()(torch.zeros(1))


def test_yielding_something_else_is_a_type_error() -> None:
    @skippable(stash=["x"])
    class Odd(nn.Module):
        def forward(self, x):
            yield x
            return x

    with pytest.raises(TypeError, match=r"the forward of Odd yielded Tensor; a skippable"):
        Odd()(torch.zeros(1))


def test_stash_and_pop_argument_errors() -> None:
    with pytest.raises(TypeError, match=r"skip name must be a string \(name: 1\)"):
        stash(1, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"stash takes a tensor or None \(name: 'x', tensor: list"):
        stash("x", [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"skip name must be a string \(name: None\)"):
        pop(None)  # type: ignore[arg-type]


def test_decorator_argument_errors() -> None:
    with pytest.raises(TypeError, match=r"stash must be a list of skip names \(stash: 'x'\)"):
        skippable(stash="x")
    with pytest.raises(TypeError, match=r"pop must contain only strings \(pop: \[1\]\)"):
        skippable(pop=[1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"stash names a skip twice \(stash: \['x', 'x'\]\)"):
        skippable(stash=["x", "x"])
    with pytest.raises(ValueError, match=r"both stashed and popped by one class"):
        skippable(stash=["x"], pop=["x"])
    with pytest.raises(TypeError, match=r"skippable decorates nn.Module subclasses"):
        skippable(stash=["x"])(object)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Save is already skippable"):
        skippable(pop=["y"])(Save)


def test_error_in_forward_closes_the_generator_and_leaves_the_layer_usable() -> None:
    closed: list[bool] = []

    @skippable(pop=["skip"])
    class Fails(nn.Module):
        fail = True

        def forward(self, x):
            try:
                skip = yield pop("skip")
                if self.fail:
                    raise ValueError("boom")
                return x + skip
            finally:
                closed.append(True)

    model = nn.Sequential(Save(), Fails())
    with pytest.raises(ValueError, match="boom"):
        model(torch.zeros(1, 3))
    assert closed == [True]
    model[1].fail = False
    assert model(torch.zeros(1, 3)).shape == (1, 3)


def test_subclass_may_override_the_generator_forward() -> None:
    class Doubled(Save):
        def forward(self, x):
            yield stash("skip", x * 2)
            return x

    with use_skip_tracker(SkipTracker()) as tracker:
        Doubled()(torch.ones(1, 3))
        torch.testing.assert_close(
            tracker.pop((DEFAULT_NAMESPACE, "skip")), torch.full((1, 3), 2.0)
        )


def test_isolate_inside_init() -> None:
    ns = Namespace()

    @skippable(stash=["x"])
    class SelfIsolating(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.isolate(ns)

        def forward(self, x):
            yield stash("x", x)
            return x

    assert SelfIsolating().namespace_of("x") == ns


def test_namespaces_survive_deepcopy_and_pickle() -> None:
    ns = Namespace()
    assert ns != Namespace() and ns == ns and hash(ns) == hash(copy.copy(ns))
    layer = Save().isolate(ns)
    assert copy.deepcopy(layer).namespace_of("skip") == ns
    assert pickle.loads(pickle.dumps(ns)) == ns
    assert pickle.loads(pickle.dumps(DEFAULT_NAMESPACE)) == DEFAULT_NAMESPACE
    model = nn.Sequential(Save().isolate(ns), Add().isolate(ns))
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded[0].namespace_of("skip") == loaded[1].namespace_of("skip") == ns
    assert repr(DEFAULT_NAMESPACE) == "<default namespace>"
    assert repr(ns).startswith("<Namespace ")


def test_checkpointing_a_block_with_its_stash_and_pop() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(Save(), nn.Linear(3, 3), Add())
    x = torch.randn(4, 3, requires_grad=True)
    out = checkpoint(block, x)
    out.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    for p in block.parameters():
        p.grad = None
    x2 = x.detach().clone().requires_grad_()
    block(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for got, p in zip(grads, block.parameters()):
        torch.testing.assert_close(got, p.grad)


def test_default_trackers_are_per_thread() -> None:
    model = nn.Sequential(Save(), Add())
    x = torch.randn(2, 3)
    expected = model(x)
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                results.append(model(x))
            assert len(current_skip_tracker()) == 0
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 150
    for result in results:
        torch.testing.assert_close(result, expected)


def test_use_skip_tracker_restores_the_previous_tracker() -> None:
    default = current_skip_tracker()
    outer, inner = SkipTracker(), SkipTracker()
    with use_skip_tracker(outer):
        with use_skip_tracker(inner):
            assert current_skip_tracker() is inner
            Save()(torch.zeros(1, 3))
        assert current_skip_tracker() is outer
    assert current_skip_tracker() is default
    assert len(inner) == 1 and len(outer) == 0
    tracker = use_skip_tracker({})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tracker must be a SkipTracker \(tracker: dict\)"):
        tracker.__enter__()


def test_an_unpopped_stash_is_replaced_not_accumulated() -> None:
    # An exception between stash and pop leaves the stash behind; the next stash under the
    # same name replaces it, so repeated failures cannot grow memory.
    save = Save()
    for _ in range(5):
        save(torch.zeros(1, 3))
    assert len(current_skip_tracker()) == 1
    current_skip_tracker().clear()


def test_no_skip_tensor_outlives_its_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Save(), nn.Linear(3, 3), Add())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 3)).square().mean().backward()
        optimizer.step()

    import gc

    for _ in range(10):
        step()
    gc.collect()
    before = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    for _ in range(200):
        step()
        assert len(current_skip_tracker()) == 0
    gc.collect()
    after = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    assert after <= before


def test_module_needs_no_gpipe_core() -> None:
    import gpipe_skip

    assert gpipe_skip.__file__ is not None
    if "gpipe_core" in sys.modules:
        pytest.skip("gpipe_core was imported by another test in this session")
    assert "gpipe_core" not in sys.modules


def test_subclass_generator_may_yield_from_the_parent_forward() -> None:
    @skippable(stash=["skip"])
    class Base(nn.Module):
        def forward(self, x):
            yield stash("skip", x + 1)
            return x * 2

    class Sub(Base):
        def forward(self, x):
            out = yield from super().forward(x)
            return out + 10

    class SubSub(Sub):
        def forward(self, x):
            out = yield from super().forward(x)
            return -out

    with use_skip_tracker(SkipTracker()) as tracker:
        torch.testing.assert_close(Sub()(torch.ones(1)), torch.full((1,), 12.0))
        torch.testing.assert_close(tracker.pop((DEFAULT_NAMESPACE, "skip")), torch.full((1,), 2.0))
        torch.testing.assert_close(SubSub()(torch.ones(1)), torch.full((1,), -12.0))
        torch.testing.assert_close(tracker.pop((DEFAULT_NAMESPACE, "skip")), torch.full((1,), 2.0))
        # Driven again after a call: the re-entry mark does not outlive the call.
        torch.testing.assert_close(Base()(torch.ones(1)), torch.full((1,), 2.0))
        tracker.pop((DEFAULT_NAMESPACE, "skip"))


def test_a_tracker_records_its_stashes_only_when_asked() -> None:
    # A long-lived tracker (the thread's default) must not grow with every stash.
    key = ("ns", "skip")
    quiet = SkipTracker()
    quiet.stash(key, torch.ones(1))  # type: ignore[arg-type]
    assert quiet.history is None
    recording = SkipTracker(history=True)
    recording.stash(key, torch.ones(1))  # type: ignore[arg-type]
    recording.stash(key, None)  # type: ignore[arg-type]
    assert recording.history == [(key, True), (key, False)]
