"""The methods of :class:`~gpipe_core.GPipe` that every rank calls together outside a run of
the pipeline: :meth:`~Collectives.clip_grad_norm_` (the gradient norm of the whole
pipeline, :mod:`gpipe_core._clip`) and :meth:`~Collectives.shared_drift` (how far the
replicas of shared tensors are from their owners', :mod:`gpipe_core._shared`).

Across processes each is a run of its own on the placement's transport, in which the ranks
compare the method called and its arguments, then exchange what they computed. In one
process each is a call over the layers. This module must not know how a run of the
pipeline goes: GPipe sets the attributes it declares.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ._build import Configuration
from ._clip import check_clip_arguments, clip_by_norms, gradient_norms
from ._layers import LayersModule
from ._placement import Placement
from .run._worker import WorkerPool
from .transport._session import Session, run_session

__all__ = ["Collectives"]


class Collectives(LayersModule):
    """A pipeline's layers with the methods every rank calls together (the base of
    :class:`~gpipe_core.GPipe`, which sets the attributes below)."""

    _config: Configuration
    _pool: WorkerPool

    @property
    def _placement(self) -> Placement:
        return self._config.placement

    def _run_session(self) -> AbstractContextManager[Session]:
        """A run's session on the pipeline's transport (see
        :func:`~gpipe_core.transport._session.run_session`), refused from inside a run of
        the pipeline's own workers."""
        self._pool.refuse_reentry()
        return run_session(self._placement.transport())

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of the whole pipeline by their total norm, as
        :func:`torch.nn.utils.clip_grad_norm_` clips the plain module's.

        The total norm is that of every parameter's gradient (each shared parameter
        once), as if they were one vector; if it exceeds ``max_norm``, every gradient is
        scaled by ``max_norm / (total_norm + 1e-6)``. In one process this is torch's
        function over :meth:`~torch.nn.Module.parameters`.

        With ``group`` (across processes), every rank calls it with the same arguments,
        after :meth:`step`: the ranks exchange the norms of their gradients, each rank
        counting its own parameters (a shared parameter's replicas once, on its owner's
        rank), and every rank scales by the same factor and returns the same total norm,
        the plain module's. With ``data_group``, each replica of the pipeline holds the
        averaged gradients already: the norm is over the pipeline's ranks, and the
        replicas are not counted twice.

        ``max_norm`` and ``norm_type`` each take what torch's function takes: a Python or
        NumPy number (``np.float32(1.0)``, ``np.int64(2)``), or a tensor or array of one
        element (a 0-dim tensor).

        Args:
            max_norm: the largest total norm kept.
            norm_type: the order of the norm (``float('inf')`` or ``'inf'`` for the largest
                absolute value).
            error_if_nonfinite: raise if the total norm is ``nan`` or infinite (the
                gradients are then unchanged); else scale by it, as torch does.
            foreach: use torch's ``foreach`` kernels (None: where they are supported).

        Returns:
            The total norm of the gradients before clipping (a scalar tensor).

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a number (a bool, a string
                for ``max_norm``, a tensor of several elements or a complex one), or
                ``error_if_nonfinite`` is not a bool.
            ValueError: ``norm_type`` is a string that is not a number.
            RuntimeError: ``error_if_nonfinite`` and the total norm is not finite (on every
                rank).

        Example:
            >>> from gpipe_core import GPipe
            >>> model = GPipe(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), [1, 1], chunks=2)
            >>> losses = model.step(torch.randn(8, 4), torch.randn(8, 1), nn.MSELoss())
            >>> total = model.clip_grad_norm_(0.5)
            >>> clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            >>> bool(clipped <= 0.5 + 1e-4), total.shape
            (True, torch.Size([]))
        """
        max_norm, norm_type = check_clip_arguments(max_norm, norm_type, error_if_nonfinite)
        if not self._placement.spans_processes:
            return torch.nn.utils.clip_grad_norm_(
                self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach
            )
        fields = (
            ("the method called", "clip_grad_norm_"),
            ("max_norm", max_norm),
            ("norm_type", norm_type),
            ("error_if_nonfinite", error_if_nonfinite),
        )
        counted = (
            (name, p)
            for name, p in self._plain_named_parameters()
            if name not in self._config.shared.foreign
        )
        with self._run_session() as session:
            self._placement.share_plan((), fields)
            session.payload = norms = gradient_norms(counted, norm_type, foreach)
        for theirs in session.payloads.values():
            norms.update(theirs)
        return clip_by_norms(
            self.parameters(), norms, self._config.parameter_names,
            max_norm, norm_type, error_if_nonfinite, foreach,
        )  # fmt: skip

    def shared_drift(self) -> dict[str, float]:
        """How far the replicas of each shared (tied) parameter or buffer that this process
        holds are from the owner's: the largest absolute difference, under the plain
        module's name of the tensor (its first use).

        In one process a shared tensor is one tensor (0.0). Across processes, each rank
        that uses it keeps a replica, made equal at construction and given the summed
        gradient at each :meth:`step`: an optimizer that treats the replicas alike keeps
        them equal, and this says whether it did. Every rank calls it, as it calls
        :meth:`step` (the ranks compare the methods they call: a rank that calls it alone
        while the others step makes every rank raise the same error, and the next step
        runs); they get the same numbers.

        Example:
            >>> from gpipe_core import GPipe
            >>> embedding = nn.Embedding(10, 4)
            >>> head = nn.Linear(4, 10, bias=False)
            >>> head.weight = embedding.weight  # tied, in partitions 0 and 1
            >>> model = GPipe(nn.Sequential(embedding, nn.Tanh(), head), [2, 1])
            >>> model.shared_drift()
            {}
        """
        if not self._config.shared.sets:  # no tensor shared across ranks: nothing to compare
            drift = self._config.shared.drift(self._placement.transport().exchange)
        else:
            fields = (("the method called", "shared_drift"),)
            with self._run_session():
                self._placement.share_plan((), fields)
                drift = self._config.shared.drift(self._placement.transport().exchange)
        renaming = self._renaming()
        if renaming is None:
            return drift
        return {renaming.rename(key) or key: value for key, value in drift.items()}
