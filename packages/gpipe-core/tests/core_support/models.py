"""The test models that several of gpipe-core's test modules build.

``MODES`` (every checkpoint mode), ``PLANS`` (every built-in schedule), ``Scale`` and
``TrainableScale``, the ``Stash``/``Pop`` pair of one skip, the ``MaybeStash``/``MaybePop``
pair of a skip that may be ``None``, the U-Net's ``Encoder``/``Decoder`` pairs
(:func:`unet_layers`), and :func:`count_and_retain` for layers that count the hooks on an
activation and retain its gradient; layers that pass dicts and a ``ModelOutput``-like
:class:`Output` and take keyword inputs (:func:`mapping_model`); :class:`Redraws`, a layer
with dropout (under torch's checkpoint or not) that records each pass's masks, and
:func:`redraws_model` of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping
from typing import Any, get_args

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from gpipe_core import CheckpointMode
from gpipe_skip import Namespace, pop, skippable, stash

#: Every checkpoint mode of GPipe.
MODES: tuple[str, ...] = get_args(CheckpointMode)

#: Every built-in schedule as a test runs it on four partitions: (schedule, placement),
#: one partition per worker where the placement is None, two per worker otherwise (on
#: ``devices=["cpu", "cpu"]``; interleaved 1F1B then needs an even number of micro-batches,
#: or at most two).
PLANS: list[tuple[str, str | None]] = [
    ("gpipe", None),
    ("1f1b", None),
    ("zb-h1", None),
    ("interleaved-1f1b", "loop"),
    ("zb-h1", "loop"),
    ("zbv", "v"),
    ("1f1b", "v"),
]


def placed(placement: str | None) -> dict[str, Any]:
    """GPipe's keyword arguments for a plan's ``placement`` (see :data:`PLANS`)."""
    return {"devices": ["cpu", "cpu"], "placement": placement} if placement else {}


class Scale(nn.Module):
    """Multiplies its input by a constant ``factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class TrainableScale(nn.Module):
    """Multiplies its input by a trainable float64 scalar (1.5 at first); elementwise, so
    that gradients expose dropout masks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Stashes its input as ``skip`` and returns it."""

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class Pop(nn.Module):
    """Adds ``skip``, popped from its :class:`Stash`, to its input."""

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        skip = yield pop("skip")
        return x + skip


@skippable(stash=["maybe"])
class MaybeStash(nn.Module):
    """Stashes ``x * 2`` as ``maybe`` while ``active``, else ``None``; returns ``x + 1``."""

    def __init__(self, active: bool = True) -> None:
        super().__init__()
        self.active = active

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("maybe", x * 2 if self.active else None)
        return x + 1


@skippable(pop=["maybe"])
class MaybePop(nn.Module):
    """Multiplies its input by ``maybe`` where that is not ``None``."""

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        skip = yield pop("maybe")
        return x if skip is None else x * skip


@skippable(stash=["skip"])
class Encoder(nn.Module):
    """The first half of a U-Net's pair: stashes its input as ``skip``, returns
    ``tanh(linear(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("skip", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["skip"])
class Decoder(nn.Module):
    """The second half: ``tanh(linear(x)) * 0.5 + skip``, with its encoder's ``skip``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        skip = yield pop("skip")
        return torch.tanh(self.linear(x)) * 0.5 + skip


def unet_layers(depth: int, width: int, bottleneck: nn.Module | None = None) -> list[nn.Module]:
    """A U-Net's layers: ``depth`` encoders, the ``bottleneck`` (a linear layer and a ReLU
    by default), then the decoders in reverse order, every pair in its own namespace
    (made in that order, so that a seed set before gives the same weights)."""
    namespaces = [Namespace() for _ in range(depth)]
    encoders: list[nn.Module] = [Encoder(width).isolate(ns) for ns in namespaces]
    if bottleneck is None:
        bottleneck = nn.Sequential(nn.Linear(width, width), nn.ReLU())
    decoders: list[nn.Module] = [Decoder(width).isolate(ns) for ns in reversed(namespaces)]
    return [*encoders, bottleneck, *decoders]


def count_and_retain(
    y: torch.Tensor, count: Callable[[torch.Tensor], None], kept: list[torch.Tensor]
) -> None:
    """On an activation that needs grad: a hook that calls ``count``, and ``retain_grad()``
    (the activation goes into ``kept``, whose gradients a test compares)."""
    if y.requires_grad:
        y.register_hook(count)
        y.retain_grad()
        kept.append(y)


# -- mappings between partitions, keyword inputs (issue 36) -------------------------------


class Output(OrderedDict[str, Any]):
    """Made as Hugging Face's ``ModelOutput``: an OrderedDict subclass built from keywords,
    holding the keys of the values given (not None)."""

    def __init__(self, *, hidden: Any = None, gate: Any = None, note: Any = None) -> None:
        super().__init__()
        for key, value in (("hidden", hidden), ("gate", gate), ("note", note)):
            if value is not None:
                self[key] = value


class ToDict(nn.Module):
    """A tensor (and, as the first layer, keyword inputs) in; a dict of tensors and values
    out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> dict[str, Any]:
        hidden = self.linear(x) * scale
        if mask is not None:
            hidden = hidden * mask
        return {"hidden": hidden, "gate": torch.sigmoid(hidden), "note": "n", "none": None}


class DictToOutput(nn.Module):
    """A dict in, an :class:`Output` out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, values: dict[str, Any]) -> Output:
        assert type(values) is dict and values["note"] == "n" and values["none"] is None
        return Output(hidden=self.linear(values["hidden"]) * values["gate"], gate=values["gate"])


class OutputToDict(nn.Module):
    """An :class:`Output` in, a dict out."""

    def forward(self, values: Output) -> dict[str, Any]:
        assert type(values) is Output
        hidden = values["hidden"].tanh()
        return {"hidden": hidden, "gate": values["gate"], "note": "n", "none": None}


class FromMapping(nn.Module):
    """A mapping in, a tensor out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, values: Mapping[str, Any]) -> torch.Tensor:
        return self.linear(values["hidden"] + values["gate"])


def mapping_model(width: int, seed: int, repeat: int = 1) -> nn.Sequential:
    """``ToDict`` (which takes keyword inputs), then dicts and :class:`Output` between every
    layer, and a tensor out: ``2 * repeat + 3`` layers."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [ToDict(width)]
    for _ in range(repeat):
        layers += [DictToOutput(width), OutputToDict()]
    layers += [DictToOutput(width), FromMapping(width)]
    return nn.Sequential(*layers).double()


#: How a :class:`Redraws` layer runs: plainly, or under torch's checkpoint (reentrant or not).
REDRAWS = (None, "reentrant", "non-reentrant")


class Redraws(nn.Module):
    """A residual linear layer whose branch is dropped out (``p=0.5``, drawn from the global
    generator), plainly or under ``torch.utils.checkpoint`` (``how``: one of
    :data:`REDRAWS`); the residual keeps every sample's input distinct.

    Each pass records the mask it drew for each sample, by the sample's input (its bytes):
    a recomputation (gpipe's or torch's) records the same sample again, so ``masks``
    holds, per sample, the first pass's mask followed by those of its recomputations.
    With ``replay`` set, the layer draws nothing and applies each sample's first mask:
    the plain model then computes what the pipeline's first passes did.
    """

    def __init__(self, width: int, how: str | None) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.how = how
        self.masks: dict[bytes, list[torch.Tensor]] = {}
        self.replay = False

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.linear(x))
        keys = [row.detach().cpu().numpy().tobytes() for row in x]
        if self.replay:
            mask = torch.stack([self._first_mask(row) for row in x.detach()])
        else:
            mask = nn.functional.dropout(torch.ones_like(hidden), 0.5, training=True)
            for key, row in zip(keys, mask.detach(), strict=True):
                self.masks.setdefault(key, []).append(row.clone())
        return x + hidden * mask

    def _first_mask(self, row: torch.Tensor) -> torch.Tensor:
        """The first mask of the sample whose recorded input ``row`` is: the plain model
        computes its inputs on the whole batch, which may round otherwise than the
        pipeline's micro-batches did (a matrix product's kernel depends on its batch
        size), so the nearest recorded input, within float64's rounding of a few layers."""
        inputs = torch.stack(
            [torch.frombuffer(bytearray(key), dtype=row.dtype) for key in self.masks]
        )
        distances = (inputs - row.cpu()).abs().amax(dim=1)
        nearest = int(distances.argmin())
        assert distances[nearest] <= 1e-10, ("no recorded input of this sample", distances)
        return self.masks[list(self.masks)[nearest]][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how is None:
            return self._body(x)
        return torch_checkpoint(self._body, x, use_reentrant=self.how == "reentrant")  # type: ignore[no-any-return]


def redraws_model(width: int, hows: list[str | None], seed: int) -> nn.Sequential:
    """A linear layer (so that every :class:`Redraws` input needs gradients), then a
    :class:`Redraws` layer per entry of ``hows``, in float64."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(width, width)]
    layers += [Redraws(width, how) for how in hows]
    return nn.Sequential(*layers).double()


def redrawn(model: nn.Module) -> list[Redraws]:
    """The :class:`Redraws` layers of ``model``."""
    return [module for module in model.modules() if isinstance(module, Redraws)]


def assert_replayed(model: nn.Module) -> int:
    """Check that every recomputation of ``model``'s :class:`Redraws` layers drew its
    sample's first mask; return how many recomputations there were."""
    recomputed = 0
    for layer in redrawn(model):
        for masks in layer.masks.values():
            for again in masks[1:]:
                assert torch.equal(again, masks[0]), f"{layer.how}: a recomputation redrew"
            recomputed += len(masks) - 1
    return recomputed


def replay_into(plain: nn.Module, model: nn.Module) -> None:
    """Give ``plain``'s :class:`Redraws` layers ``model``'s first masks, replayed (the
    layers stay in replay: they draw nothing from then on)."""
    for mine, theirs in zip(redrawn(plain), redrawn(model), strict=True):
        mine.masks, mine.replay = theirs.masks, True
