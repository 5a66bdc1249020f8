"""An action of a schedule, and the phases of a run: one enum for both.

An action names a micro-batch ``i``, a partition ``j`` and what to do: its kind, one of
the four :class:`Phase` members that a schedule orders (the forward pass ``F``, the
backward pass ``B``, or the backward pass split in two: the input gradient ``I`` and the
weight gradient ``W``). A timeline records the same phases, and three that no schedule
names (recompute, copy, loss).

It must not know schedules, tensors, devices or threads: an action is data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

__all__ = ["Action", "Phase"]


class Phase(str, Enum):
    """What a task does; the first, third, fourth and fifth are also the kinds of action
    a schedule orders (an :class:`~gpipe_core.Action`'s ``kind``).

    Each member equals its value (``Phase.FORWARD == "forward"``), which is what a
    timeline's JSON and labels print. ``Phase("input")`` and ``Phase("weight")`` (the
    action kinds' short names) are ``INPUT_GRADIENT`` and ``WEIGHT_GRADIENT``.

    Attributes:
        FORWARD: the forward pass of a partition on a micro-batch (without autograd
            history when the micro-batch is checkpointed); action ``F``.
        RECOMPUTE: the forward pass re-run, with autograd, right before the backward pass
            of a checkpointed micro-batch.
        BACKWARD: the backward pass of a partition on a micro-batch; action ``B``.
        INPUT_GRADIENT: the first half of a split backward pass: the gradient of the
            partition's input, sent upstream at once; action ``I``.
        WEIGHT_GRADIENT: the second half: the gradients of the partition's parameters;
            action ``W``.
        COPY: a micro-batch (or its gradient, in backward) copied between the devices of
            two neighbouring partitions.
        LOSS: the loss of a micro-batch on the last partition, in a step.

    Example:
        >>> Phase("input") is Phase.INPUT_GRADIENT, Phase.WEIGHT_GRADIENT.letter
        (True, 'W')
        >>> [p.letter for p in Phase if p.is_action]
        ['F', 'B', 'I', 'W']
    """

    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    INPUT_GRADIENT = "input-gradient"
    WEIGHT_GRADIENT = "weight-gradient"
    COPY = "copy"
    LOSS = "loss"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> Phase | None:
        return _ALIASES.get(value) if isinstance(value, str) else None

    @property
    def letter(self) -> str:
        """The letter of an action of this kind (``F``, ``B``, ``I``, ``W``); ``""`` for
        the phases that are not action kinds."""
        return _LETTERS.get(self, "")

    @property
    def is_action(self) -> bool:
        """Whether a schedule's actions are of this kind (forward, backward, input or
        weight gradient)."""
        return self in _LETTERS


#: The short names of the split backward's halves (the action kinds' names in schedules).
_ALIASES: dict[str, Phase] = {"input": Phase.INPUT_GRADIENT, "weight": Phase.WEIGHT_GRADIENT}
_LETTERS: dict[Phase, str] = {
    Phase.FORWARD: "F",
    Phase.BACKWARD: "B",
    Phase.INPUT_GRADIENT: "I",
    Phase.WEIGHT_GRADIENT: "W",
}
_BY_LETTER: dict[str, Phase] = {letter: kind for kind, letter in _LETTERS.items()}
#: Each action kind's name in :func:`repr` (and in ``durations``): the short names.
KIND_NAMES: dict[Phase, str] = {
    Phase.FORWARD: "forward",
    Phase.BACKWARD: "backward",
    Phase.INPUT_GRADIENT: "input",
    Phase.WEIGHT_GRADIENT: "weight",
}
#: The kinds that send a gradient upstream: the whole backward pass, or its input gradient.
GRADIENT_KINDS = (Phase.BACKWARD, Phase.INPUT_GRADIENT)
_PRINTED = re.compile(r"(0|[1-9][0-9]*)?([FBIW])(0|[1-9][0-9]*)")


def action_kind(kind: object) -> Phase:
    """``kind`` as the :class:`Phase` member of an action kind: the member itself, its
    value or its short name (``"forward"``, ``"backward"``, ``"input"``, ``"weight"``).

    Raises:
        ValueError: ``kind`` is none of the four.
    """
    if isinstance(kind, Phase):
        if kind in _LETTERS:
            return kind
    elif isinstance(kind, str):
        try:
            found = Phase(kind)
        except ValueError:
            pass
        else:
            if found in _LETTERS:
                return found
    raise ValueError(
        f"an action's kind must be one of {list(KIND_NAMES.values())} or a Phase of them "
        f"(kind: {kind!r})"
    )


@dataclass(frozen=True, slots=True, init=False)
class Action:
    """One action of a worker: the forward pass, backward pass, input gradient or weight
    gradient of one micro-batch, on one partition (None: the worker's only partition).

    Written ``F3`` (``B``, ``I``, ``W``) without a partition, ``2F3`` (partition 2) with
    one; ``Action.parse`` reads that back. The kind is given as a :class:`Phase` member, its
    value or its short name (``"forward"``, ``"backward"``, ``"input"``, ``"weight"``),
    and held as the member.

    Example:
        >>> Action("forward", 3), str(Action("backward", 0)), str(Action("input", 1, 2))
        (Action('forward', 3), 'B0', '2I1')
        >>> Action("input", 1, 2).kind is Phase.INPUT_GRADIENT
        True
    """

    kind: Phase
    microbatch: int
    partition: int | None

    def __init__(self, kind: Phase | str, microbatch: int, partition: int | None = None) -> None:
        object.__setattr__(
            self,
            "kind",
            kind if kind.__class__ is Phase and kind in _LETTERS else action_kind(kind),
        )
        object.__setattr__(self, "microbatch", microbatch)
        object.__setattr__(self, "partition", partition)

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``str()`` prints as ``text``: ``"F3"``, ``"2B0"``, ``"1I2"``, ``"W0"``.

        Raises:
            ValueError: ``text`` is not an action as ``str()`` prints one.

        Example:
            >>> Action.parse("2F3"), Action.parse("W0")
            (Action('forward', 3, 2), Action('weight', 0))
        """
        match = _PRINTED.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                "an action must read as printed: an optional partition, a letter of F, B, "
                f"I or W and a micro-batch, like 'F3' or '2B0' (text: {text!r})"
            )
        partition, letter, microbatch = match.groups()
        return cls(
            _BY_LETTER[letter], int(microbatch), None if partition is None else int(partition)
        )

    def __str__(self) -> str:
        label = _LETTERS[self.kind] + str(self.microbatch)
        return label if self.partition is None else f"{self.partition}{label}"

    def __repr__(self) -> str:
        name = KIND_NAMES[self.kind]
        if self.partition is None:
            return f"Action({name!r}, {self.microbatch})"
        return f"Action({name!r}, {self.microbatch}, {self.partition})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Action, (self.kind, self.microbatch, self.partition))


def forward_of(i: int, j: int | None = None) -> Action:
    """The forward action of micro-batch ``i`` (on partition ``j``)."""
    return Action(Phase.FORWARD, i, j)


def backward_of(i: int, j: int | None = None) -> Action:
    """The backward action of micro-batch ``i`` (on partition ``j``)."""
    return Action(Phase.BACKWARD, i, j)


def action_label(action: Action, identity: bool) -> str:
    """``action`` as printed, without its partition where each worker runs one
    (``identity``: partition ``j`` on worker ``j``)."""
    return str(replace(action, partition=None) if identity else action)
