"""The decode run of :class:`~gpipe_core.GPipe`: :meth:`~Decoding.decode`, a forward run
over lanes round after round, each lane's next input made from its output (see
:mod:`gpipe_core.run._lanes`).

This module must not know how a run goes: :func:`~gpipe_core.run._run.run_decode` runs it;
GPipe sets the attributes it declares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._collectives import Collectives
from ._stream import AbstractStream
from .run._lanes import Feedback
from .run._run import Runtime, run_decode

__all__ = ["Decoding"]


class Decoding(Collectives):
    """A pipeline's layers with its decode run (a base of :class:`~gpipe_core.GPipe`,
    which sets the attributes below)."""

    _copy_streams: list[list[AbstractStream]]

    @property
    def _runtime(self) -> Runtime:
        """What this pipeline's runs run with (its forward, step and decode runs)."""
        return Runtime(self._config, self, self._pool, self._copy_streams)

    def decode(
        self,
        *inputs: Any,
        feedback: Feedback,
        rounds: int,
        agree: Mapping[str, object] | None = None,
        result: Callable[[], object] | None = None,
        **keywords: Any,
    ) -> object:
        """Run lanes through the pipeline round after round, each lane's next input made from
        its last output: a forward pass without autograd history whose layers keep state
        per lane (a cache, with :func:`~gpipe_core.lane_state`), as autoregressive decoding
        needs.

        The input (as :meth:`forward` takes it) is split into ``chunks`` micro-batches, the
        *lanes*. Each round runs every lane through every partition: partition ``j``
        computes lane ``i`` while partition ``j - 1`` computes lane ``i + 1``
        (:class:`~gpipe_core.DecodeSchedule`), so that with at least as many lanes as
        partitions no partition waits once the first round has filled the pipeline. On
        the last partition's process, ``feedback(lane, round, output)`` gets the lane's
        output of each round and returns its next input, in the first round's form (a
        tensor, a tuple of positional inputs, or a dict of the same keywords), on any
        device: it goes to the first partition's device. A lane whose feedback returns
        None has stopped: its later rounds compute nothing. The value returned for the
        last round is not used. The lanes' states are dropped when the call returns or
        raises.

        Args:
            inputs: the first round's positional inputs, as :meth:`forward` takes them.
            feedback: ``feedback(lane, round, output) -> next input | None``, called on the
                last partition's process (in one of its worker threads), lane by lane.
            rounds: how many rounds each lane runs.
            agree: values the ranks must agree on (a generation's options, say): the run
                is refused on every rank if any differs (:class:`~gpipe_core.RanksDisagree`).
            result: called on the last partition's process once every round has run; what
                it returns (across processes: a value that pickles, without tensors) is
                returned on every rank.
            keywords: the first round's keyword inputs.

        Returns:
            What ``result`` returns (None without it).

        Raises:
            ValueError: ``rounds`` is not a positive integer, the pipeline is empty, or the
                input is refused as :meth:`forward` refuses it.
            TypeError: ``feedback`` is not callable, or returned a value in another form
                than the first round's input.

        With ``group`` (across processes), every rank calls it alike; the first
        partition's rank reads the inputs and the last partition's calls the feedback.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from gpipe_core import GPipe, lane_state
            >>> class Count(nn.Module):  # adds the number of rounds its lane has seen
            ...     def forward(self, x):
            ...         state = lane_state(self)
            ...         state["seen"] = state.get("seen", 0) + 1
            ...         return x + state["seen"]
            >>> model = GPipe(nn.Sequential(Count(), Count()), [1, 1], chunks=2)
            >>> seen = {}
            >>> def feedback(lane, round, output):
            ...     seen[lane, round] = output.flatten().tolist()
            ...     return output
            >>> model.decode(torch.zeros(2, 1), feedback=feedback, rounds=3)
            >>> seen[0, 0], seen[0, 1], seen[1, 2]
            ([2.0], [6.0], [12.0])
        """
        fields = tuple((str(name), value) for name, value in (agree or {}).items())
        last = self._placement.is_local(-1)
        with self._run_session() as session:
            run_decode(self._runtime, inputs, keywords, feedback, rounds, fields)
            if result is not None and last:
                value = result()
                session.payload = value
        if result is None:
            return None
        return value if last else session.payloads[self.partition_ranks[-1]]
