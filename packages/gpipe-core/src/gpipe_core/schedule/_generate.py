"""Action lists generated in unit time: per-partition lists merged into a worker's list,
and the zero-bubble lists (ZB-H1's and ZB-V's weight gradients placed where a worker would
wait, ZB-V's order over a V placement).

It must not know tensors, devices, threads or transports: it makes lists of actions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._action import GRADIENT_KINDS, Action, Phase
from ._check import dependencies
from ._placement import partitions_of

__all__: list[str] = []


def generate(
    partitions: int,
    workers: Sequence[int],
    pending: Sequence[set[Action]],
    choose: Callable[[int, list[Action]], Action | None],
) -> list[list[Action]]:
    """Each worker's list, built on a unit-time clock (every action one unit): each free
    worker runs ``choose(worker, ready)``'s pick among its ready actions (None:
    idle). ``pending`` holds each worker's actions still to run (emptied)."""
    gradients = {
        (a.microbatch, a.partition): a
        for actions in pending
        for a in actions
        if a.kind in GRADIENT_KINDS
    }
    done: set[Action] = set()
    lists: list[list[Action]] = [[] for _ in pending]
    while any(pending):
        ran: list[Action] = []
        for w, todo in enumerate(pending):
            ready = [
                a
                for a in todo
                if all(d in done for d in dependencies(a, partitions, gradients))
                and (
                    a.kind is Phase.FORWARD
                    or Action(Phase.FORWARD, a.microbatch, a.partition) in done
                )
            ]
            pick = choose(w, ready) if ready else None
            if pick is not None:
                todo.remove(pick)
                lists[w].append(pick)
                ran.append(pick)
        if not ran:
            raise AssertionError(f"schedule generation stalled (placement: {list(workers)})")
        done.update(ran)
    return lists


def merge(per_partition: Sequence[Sequence[Action]], workers: Sequence[int]) -> list[list[Action]]:
    """Per-partition lists (partitions resolved) merged into per-worker lists: each worker
    runs the next action of one of its partitions when it is ready, the later partition's
    first."""
    heads = [0] * len(per_partition)
    owned = partitions_of(workers)

    def choose(w: int, ready: list[Action]) -> Action | None:
        for j in reversed(owned[w]):
            if heads[j] < len(per_partition[j]) and per_partition[j][heads[j]] in ready:
                heads[j] += 1
                return per_partition[j][heads[j] - 1]
        return None

    pending = [{a for j in owned[w] for a in per_partition[j]} for w in range(len(owned))]
    return generate(len(workers), workers, pending, choose)


def fill_weights(
    base: Sequence[Sequence[Action]], workers: Sequence[int], cap: int | None = None
) -> list[list[Action]]:
    """``base`` (per worker: forward passes and input gradients) with the weight gradients
    placed: each worker runs its next base action when ready, unless it is a forward pass
    that would hold more than ``cap`` micro-batches (forward pass run, weight gradient
    not yet; default: the most the base list holds, forward pass run, input gradient
    not yet); else its oldest pending weight gradient; else it waits."""
    if cap is None:
        cap = 0
        for actions in base:
            live = 0
            for action in actions:
                live += 1 if action.kind is Phase.FORWARD else -1
                cap = max(cap, live)
    heads = [0] * len(base)
    held = [0] * len(base)  # forward passes run whose weight gradient has not
    weights: list[list[Action]] = [[] for _ in base]

    def choose(w: int, ready: list[Action]) -> Action | None:
        actions = base[w]
        if heads[w] < len(actions):
            action = actions[heads[w]]
            if action in ready and (action.kind is not Phase.FORWARD or held[w] < cap):
                heads[w] += 1
                if action.kind is Phase.FORWARD:
                    held[w] += 1
                else:
                    weights[w].append(
                        Action(Phase.WEIGHT_GRADIENT, action.microbatch, action.partition)
                    )
                return action
        for weight in weights[w]:
            if weight in ready:
                weights[w].remove(weight)
                held[w] -= 1
                return weight
        return None

    pending = [
        set(actions)
        | {
            Action(Phase.WEIGHT_GRADIENT, a.microbatch, a.partition)
            for a in actions
            if a.kind is Phase.INPUT_GRADIENT
        }
        for actions in base
    ]
    return generate(len(workers), workers, pending, choose)


def v_order(microbatches: int, worker_count: int) -> list[list[Action]]:
    """ZB-V's forward passes and input gradients, per worker of a V placement (partitions
    ``w`` and ``2W - 1 - w`` on worker ``w``), in the order :class:`~gpipe_core.ZeroBubbleVSchedule`
    describes; its weight gradients are left to :func:`fill_weights`."""
    return [_v_worker(microbatches, worker_count, w) for w in range(worker_count)]


def _v_worker(m: int, worker_count: int, w: int) -> list[Action]:
    """Worker ``w``'s forward passes and input gradients (see :func:`v_order`)."""
    partitions = (w, 2 * worker_count - 1 - w)  # on the way down, on the way up
    forwards, inputs = [0, 0], [0, 0]  # how many have run, down and up
    actions: list[Action] = []

    def add(kind: Phase, side: int) -> None:
        done = forwards if kind is Phase.FORWARD else inputs
        actions.append(Action(kind, done[side], partitions[side]))
        done[side] += 1

    for _ in range(min(2 * (worker_count - w) - 1, m)):
        add(Phase.FORWARD, 0)
    for _ in range(w):
        if forwards[1] < m:
            add(Phase.FORWARD, 1)
        if forwards[0] < m:
            add(Phase.FORWARD, 0)
    for _ in range(worker_count - w):
        if forwards[1] < min(forwards[0], m):
            add(Phase.FORWARD, 1)
            add(Phase.INPUT_GRADIENT, 1)
    while inputs[0] < m or inputs[1] < m:
        before = len(actions)
        if forwards[0] < m:
            add(Phase.FORWARD, 0)
        if inputs[0] < inputs[1]:
            add(Phase.INPUT_GRADIENT, 0)
        if forwards[1] < forwards[0]:
            add(Phase.FORWARD, 1)
        if inputs[1] < forwards[1]:
            add(Phase.INPUT_GRADIENT, 1)
        elif inputs[0] < inputs[1]:
            add(Phase.INPUT_GRADIENT, 0)
        if len(actions) == before:  # a bug, never a loop without end
            raise AssertionError(
                f"ZB-V's order is stuck on worker {w} (m={m}, workers={worker_count})"
            )
    return actions
