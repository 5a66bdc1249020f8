"""The GPipe module: a pipelined, checkpointed wrapper around an ``nn.Sequential``.

This module owns the API (the constructor, :meth:`~GPipe.forward`, :meth:`~GPipe.step`):
each call opens the run's session, describes the run and runs it. Every other job is a
module's, called from here: the construction and its checks, into one configuration
(``_build``, ``_arguments``), the run's session on the transport (``_session``), a run's
inputs parsed, checked and split (``run._inputs``), its description (``run._description``)
and execution (``run._run``), the layers under the plain module's names with the
:class:`~torch.nn.Module` protocol over them (``_layers``), the methods every rank calls
together outside a run, ``clip_grad_norm_`` and ``shared_drift`` (``_collectives``), the
decode run (``_decoding``, whose ``Decoding`` is GPipe's base), device moves (``_moves``).
Whether the pipeline spans processes it does not know beyond what its placement
(``_placement.Placement``) answers.
"""

from __future__ import annotations

import datetime
import functools
import weakref
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gpipe_microbatch import Device
from gpipe_skip import SkipLayout

from ._arguments import Arguments, CheckpointMode
from ._build import Configuration, build
from ._decoding import Decoding
from ._materialize import Init
from ._mesh import check_mesh
from ._moves import FixedDevices
from ._placement import DEFAULT_TIMEOUT, construction_for
from ._state_dict import PartitionKeys, map_keys
from ._stream import AbstractStream
from .run._inputs import UNSET
from .run._losses import Losses, LossFunction, Reduction, from_numbers, to_numbers
from .run._run import run_forward, run_step
from .run._worker import WorkerPool
from .schedule._schedules import Schedule
from .trace._timeline import Timeline
from .trace._tracing import record

__all__ = ["GPipe"]


class GPipe(FixedDevices, Decoding):
    """Pipeline parallelism with micro-batches and checkpointing, as in GPipe.

    The layers of ``module`` are split into partitions, ``balance[j]`` layers each, and
    partition ``j`` is placed on ``devices[j]``. A mini-batch is split into ``chunks``
    micro-batches that flow through the partitions in the fill-drain schedule, one worker
    thread per partition, so partitions work on different micro-batches at once (on
    several devices, or on one CPU). Outputs and gradients are those of ``module``.

    The module is called as the wrapped one would be: ``model(input)`` or
    ``model(a, b, ...)``, whose tensors are split into micro-batches (see :meth:`forward`);
    a :class:`~gpipe_core.PipeSequential` keeps its convention of unpacking tuples into the
    next layer's arguments, across partitions too.

    Args:
        module: the model to pipeline; its layers are what ``balance`` counts. An empty
            :class:`~torch.nn.Sequential` is the identity.
        balance: the number of layers in each partition. Without it (and without
            ``devices``), partitions follow where the layers already are: the runs of
            consecutive layers on one device (refused, with a hint to measure a balance,
            when every layer is on one device). :class:`~gpipe_core.WithDevice` places a
            layer without parameters; with ``balance`` given, each such layer must fall in
            a partition on its device.

    Keyword Args:
        devices: the device of each partition (default: every CUDA device in order, or
            the CPU for every partition when CUDA is not available).
        chunks: the number of micro-batches (default: 1).
        checkpoint: which micro-batches are checkpointed: ``'always'``,
            ``'except_last'`` (default) or ``'never'``. Nothing is checkpointed in eval
            mode or without grad mode.
        deferred_batch_norm: replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` with a
            :class:`~gpipe_bn.DeferredBatchNorm`, which updates its running statistics once
            per mini-batch, as the whole mini-batch would, rather than once per
            micro-batch. The layers keep their parameters and buffers; ``module`` is
            changed in place.
        group: a ``torch.distributed`` process group to run the partitions across
            processes: partition ``s`` runs on rank ``s % group.size()`` of the group,
            which keeps only its own partitions' layers (see :doc:`/distributed`). The
            messages between partitions travel on gloo: on ``group`` if it uses gloo, else on
            a gloo group of the same ranks, made here (on every rank of ``group``). Then
            ``devices`` lists the devices of this rank's partitions (default: the CUDA
            device ``LOCAL_RANK`` when CUDA is available, else the CPU), and the other
            ranks' partitions show as ``meta`` in ``devices``.
        data_group: a ``torch.distributed`` process group of this pipeline's replicas,
            which train on other data: after each :meth:`step`, the gradients of this
            process's parameters are averaged over it with one ``all_reduce`` per dtype
            (see :doc:`/distributed`). A NCCL group needs this rank's partitions on CUDA.
        timeout: with ``group`` or ``data_group``, the seconds (or a
            :class:`~datetime.timedelta`) any wait for another rank may last, from the
            constructor on, before the run fails with an error saying who waits for what
            (default: 1800; ``None``: no bound; one past a century is clamped to a
            century, which every wait holds, gloo's too). A failed step raises within the
            timeout of the wait that failed, plus the time to tell the other ranks.
        intra_op_threads: the intra-op threads (``torch.set_num_threads``) of each worker
            on the CPU. ``None`` (default): the caller's ``torch.get_num_threads()``
            divided among the workers on the CPU that compute at once, set by each worker
            as it starts a micro-batch's forward or backward pass, so that together they
            use the cores the plain model would, not ``n`` times as many; an integer: that
            many for every worker on the CPU; ``0``: torch's setting as it is (every worker
            with the whole pool). Workers set the caller's count back at the end of a run
            (see :ref:`intra-op-threads`).
        placement: several partitions per worker, where one worker thread runs the
            actions of all its partitions in one list (see :doc:`/schedules`). A worker
            is an entry of ``devices`` in one process (two ``"cpu"`` entries are two
            workers), a rank of ``group`` across processes. ``"loop"`` puts partition ``j``
            on worker ``j % W``; ``"v"`` puts partitions ``j`` and ``2W - 1 - j`` on worker
            ``j``; a list gives each partition's worker. ``None`` (default): each
            partition is a worker of its own.
        init: how this process's layers built on the meta device are initialised, after
            each module's ``reset_parameters()``: a callable called on each such layer
            (under ``torch.no_grad()``), a state dict of the plain model's keys
            (``"3.norm.weight"``) loaded into them, or a list of both, applied in order.
            A tensor of such a layer that none of them sets is refused, naming the layer
            and the tensor (no silent NaN): a layer without ``reset_parameters()`` needs
            ``init``, and so does a non-persistent buffer, which no state dict holds (see
            :ref:`meta-device`). Layers not on the meta device are left as they are.
        mesh: a :class:`~torch.distributed.device_mesh.DeviceMesh` with dimensions
            ``"pp"`` and any of ``"dp_replicate"``, ``"dp_shard"``, ``"tp"``, in place of
            ``group`` and ``data_group`` (see :doc:`/mesh`): the partitions run across
            ``mesh["pp"]``, one rank per worker; ``"dp_replicate"``'s replicas average
            their gradients as ``data_group``'s do; over ``"dp_shard"`` each partition of
            this rank is sharded with torch's :func:`~torch.distributed.fsdp.fully_shard`
            (HSDP with both), reduce-scattered once per step; ``"tp"``: the layers are
            parallelized over ``mesh["tp"]`` (``parallelize_module``) before. Every
            data-parallel rank steps on its own share of the mini-batch.
        reshard_after_forward: with ``"dp_shard"``, whether a sharded partition frees its
            gathered parameters after each micro-batch's forward (and backward) pass
            (``None``, default: True), or keeps them until the step's last backward pass.

    Across processes, the ranks compare what they build and, at every run, how they are
    called; where they differ, every rank raises the same
    :class:`~gpipe_core.RanksDisagree` (see :doc:`/distributed`). Such a pipeline runs one
    call at a time, from one thread per rank, and cannot be copied or pickled (copy
    :meth:`unwrap` or save :meth:`~torch.nn.Module.state_dict` instead).

    Raises:
        TypeError: ``module`` is not an :class:`~torch.nn.Sequential`, its skippable
            layers do not pair up (see :func:`gpipe_skip.verify_skippables`), a
            :class:`~gpipe_core.WithDevice` is nested in a layer, ``init`` is not a
            callable, a state dict or a list of them, ``mesh`` is not a ``DeviceMesh``, or
            with ``mesh`` a layer is wrapped with FSDP, or holds DTensors of another mesh
            than ``mesh["tp"]``.
        BalanceError: ``balance`` does not split ``module`` into non-empty partitions.
        ValueError: a ``mesh`` gpipe cannot run (without ``"pp"``, with another
            dimension, a ``"pp"`` size that is not the workers', a tie between sharded
            partitions of a rank, or with ``group``/``data_group``); too few devices, bad
            ``chunks``, ``checkpoint`` or ``timeout``, a
            buffer shared by partitions on different devices of this process, a
            :class:`~gpipe_core.WithDevice` layer in a partition on another device, or a
            NCCL ``data_group`` for partitions that are not on CUDA, or a ``placement``
            that does not fit the partitions and workers; a layer built on the meta
            device left with a tensor that nothing initialised (the layers go back to
            the meta device), or an ``init`` state dict with keys of no layer.
        RanksDisagree: across processes, the ranks would build different pipelines.
        RemotePartitionError: across processes, another rank's constructor failed (told
            by the ranks' agreement on the pipeline, on every rank but the failing one).
        TimeoutError: across processes, a rank did not build the pipeline within
            ``timeout``.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> model = GPipe(model, balance=[2, 1], chunks=4)
        >>> output = model(torch.randn(32, 8, device=model.devices[0]))
        >>> output.shape, output.device == model.devices[-1]
        (torch.Size([32, 2]), True)

        A model built on the meta device: the ``Linear`` has ``reset_parameters()``, the
        norm's weight needs ``init`` (without it, the constructor refuses, naming
        ``1.weight``):

        >>> class Norm(nn.Module):  # no reset_parameters()
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(2))
        ...
        ...     def forward(self, x):
        ...         return x * self.weight
        >>> def init(layer):
        ...     if isinstance(layer, Norm):
        ...         layer.weight.fill_(1.0)
        >>> with torch.device("meta"):
        ...     module = nn.Sequential(nn.Linear(2, 2), Norm())
        >>> model = GPipe(module, [2], init=init)
        >>> model.partitions[0][1].weight.tolist()
        [1.0, 1.0]
    """

    partitions: nn.ModuleList
    """The partitions, in order (another rank's are empty, across processes)."""
    skip_layout: SkipLayout
    """Which skip connections cross which partitions (see :mod:`gpipe_skip`)."""
    _config: Configuration

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = 1,
        checkpoint: CheckpointMode = "except_last",
        deferred_batch_norm: bool = False,
        group: dist.ProcessGroup | None = None,
        data_group: dist.ProcessGroup | None = None,
        timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT,
        intra_op_threads: int | None = None,
        placement: str | Sequence[int] | None = None,
        init: Init = None,
        mesh: DeviceMesh | None = None,
        reshard_after_forward: bool | None = None,
    ) -> None:
        super().__init__()
        groups = check_mesh(mesh, group, data_group, reshard_after_forward)
        if groups is not None:
            group, data_group = groups.pipeline, groups.averaged
        arguments = Arguments(
            module, balance, devices, chunks, checkpoint, deferred_batch_norm,
            group, data_group, timeout, intra_op_threads, placement, init, groups,
        )  # fmt: skip
        construction = construction_for(group)
        try:
            self._config = config = build(
                arguments, construction, self._renaming(), self._agreed_fields()
            )
            #: Keeping it is also how gpipe_skip knows that this module pairs its own skips:
            #: the ``verify_skippables`` of a model this pipeline is nested in leaves them alone.
            self.skip_layout = config.skip_layout
            self.partitions = nn.ModuleList(config.partitions)
            self._init_runtime()
            # Checkpoints use the plain module's keys, whatever the balance.
            map_keys(
                self,
                PartitionKeys(self._partition_list(), config.remote_layers, self._renaming()),
            )
            if construction is not None:
                construction.agree((), config.timeout)  # every rank has built its partitions
                self._connect_replicas()
        except BaseException as error:
            if construction is not None:
                construction.failed(error)
            raise

    def _connect_replicas(self) -> None:
        """Make the replicas of shared tensors equal to their owners', in a run of every
        rank (when some tensor is shared across ranks: the ranks agree on which)."""
        if self._config.shared.sets:
            with self._run_session():
                self._config.shared.connect(self._placement.transport().exchange)

    def _init_runtime(self) -> None:
        """The state that is not copied or pickled: copy streams and worker threads (the
        placement makes its transport anew)."""
        self._copy_streams: list[list[AbstractStream]] = [[] for _ in self.devices]
        self._pool = WorkerPool(self._placement.local_worker_count)
        # The workers and the transport's threads hold no reference to the module:
        # collecting it stops them.
        weakref.finalize(self, self._pool.close)
        weakref.finalize(self, self._placement.close)

    @property
    def chunks(self) -> int:
        """The number of micro-batches a mini-batch is split into."""
        return self._config.chunks

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        self._config.chunks = chunks

    @property
    def checkpoint(self) -> CheckpointMode:
        """Which micro-batches are checkpointed in training."""
        return self._config.checkpoint

    @checkpoint.setter
    def checkpoint(self, checkpoint: CheckpointMode) -> None:
        self._config.checkpoint = checkpoint

    @property
    def intra_op_threads(self) -> int | None:
        """The intra-op threads of each worker on the CPU (see ``intra_op_threads``)."""
        return self._config.intra_op_threads

    @intra_op_threads.setter
    def intra_op_threads(self, threads: int | None) -> None:
        self._config.intra_op_threads = threads

    @property
    def balance(self) -> list[int]:
        """The number of layers in each partition."""
        return self._placement.balance

    @property
    def devices(self) -> list[torch.device]:
        """The device of each partition (``meta`` for another rank's, across processes)."""
        return self._placement.devices

    @property
    def partition_ranks(self) -> list[int]:
        """The rank (in ``group``) of each partition; all 0 without a group."""
        return self._placement.ranks

    def __getstate__(self) -> dict[str, Any]:
        if self._placement.spans_processes:
            raise TypeError(
                "a GPipe across processes cannot be copied or pickled: it holds a process "
                f"group ({self._placement.describe_group()}) and this rank's partitions only; "
                "copy the layers instead, copy.deepcopy(pipe.unwrap()), or save "
                "pipe.state_dict()"
            )
        # Threads, locks and CUDA streams cannot be copied or pickled; a copy gets its own.
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        state.pop("_pool", None)
        state.pop("_copy_streams", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._init_runtime()

    def train(self, mode: bool = True) -> GPipe:
        """Set training mode (``mode=False``: eval mode) on the pipeline, its layers and
        its partitions, as :meth:`torch.nn.Module.train` does on a module."""
        super().train(mode)
        # The containers are not children under the plain names; they follow too.
        self.partitions.training = mode
        for partition in self.partitions:
            partition.training = mode
        return self

    # -- forward ---------------------------------------------------------------------

    def forward(self, *inputs: Any, **keywords: Any) -> Any:
        """Run a mini-batch through the pipeline, as the wrapped module would run it.

        ``model(input)`` passes ``input`` to the first layer, a tuple or a dict as one
        value, as :class:`~torch.nn.Sequential` does; ``model(a, b, ...)`` calls the first
        layer with several positional arguments, ``layer(a, b, ...)``, and
        ``model(a, mask=m)`` or ``model(**batch)`` with keyword arguments,
        ``layer(a, mask=m)``. From there on each layer gets the previous layer's output (a
        :class:`~gpipe_core.PipeSequential` unpacks tuples into positional arguments,
        across partitions too).

        The input's tensors, positional and keyword alike, are split into micro-batches
        along dimension 0. A tensor wrapped in :class:`~gpipe_microbatch.NoChunk`, and
        every value that is not a tensor (a number, a string, ``None``, a small container),
        is passed whole to every micro-batch. Partitions may return values that are not
        tensors too, beside at least one tensor, in a tuple or in a mapping (a ``dict``, a
        Hugging Face ``ModelOutput``), which the next layer gets whole with its type and
        keys.

        Args:
            inputs: one value (a tensor, or a tuple or dict passed as one value), or
                several positional arguments for the first layer. At least one tensor to
                split among them and ``keywords``; every tensor on ``devices[0]``.
            keywords: the first layer's keyword arguments, split alike.

        Returns:
            The output of the last layer, on ``devices[-1]``: its tensors concatenated over
            the micro-batches, and each value that is not a tensor as a list with one entry
            per micro-batch.

        Raises:
            TypeError: no input, an input without a tensor to split, a tensor inside
                another value (a list of tensors: pass the tensors themselves), a mapping
                with a key that is not a string or of a type that cannot be made back, a
                partition output that holds no tensor, or keyword inputs to an empty
                pipeline.
            ValueError: a tensor is not on ``devices[0]``, the tensors to split have
                different batch sizes, or the last partition's output has a tensor without
                a batch dimension to gather.
            RuntimeError: the module is called from inside its own run (a layer or hook
                calling it again); or, across processes, in training with grad enabled
                (use :meth:`step`).

        With ``group`` (across processes), every rank calls it; the first partition's rank
        takes the inputs (``model()``, ``model(None)`` or the same inputs elsewhere: they
        are not read), and the last
        partition's rank returns the output (``None`` elsewhere). Only inference runs so:
        autograd cannot reach across processes.

        Example:
            >>> from gpipe_core import NoChunk
            >>> class Masked(nn.Module):
            ...     def forward(self, x, mask, scale):
            ...         return x * mask * scale
            >>> model = GPipe(nn.Sequential(Masked(), nn.Linear(3, 2)), [1, 1], chunks=2)
            >>> x, mask = torch.randn(4, 3), torch.tensor([1.0, 0.0, 1.0])
            >>> model(x, NoChunk(mask), 0.5).shape  # the mask is not split, nor the scale
            torch.Size([4, 2])
            >>> model(x=x, mask=NoChunk(mask), scale=0.5).shape  # or by keyword
            torch.Size([4, 2])
        """
        with self._run_session():
            # Inside the run, so that the other ranks learn of the refusal at once.
            if self._placement.spans_processes and self.training and torch.is_grad_enabled():
                raise RuntimeError(
                    "GPipe across processes runs forward() for inference only (eval mode or "
                    "torch.no_grad()): autograd cannot reach across processes; train with "
                    "step(input, target, loss_fn), which runs every backward pass "
                    f"(training: {self.training}, grad enabled: {torch.is_grad_enabled()})"
                )
            return run_forward(self._runtime, inputs, keywords)

    def step(
        self,
        *inputs: Any,
        target: Any = UNSET,
        loss_fn: LossFunction | None = None,
        schedule: str | Schedule = "gpipe",
        reduction: Reduction | None = None,
        **keywords: Any,
    ) -> Losses:
        """Run a training step: forward, loss and backward of every micro-batch.

        ``input`` and ``target`` are split into micro-batches alike. Each partition's
        worker runs the forward pass of each micro-batch, the loss
        ``loss_fn(output, target)`` of each micro-batch (on the last partition), and the
        backward pass of each micro-batch, in the order ``schedule`` gives (see
        :mod:`schedules <gpipe_core.Schedule>`), each as soon as what it needs is there. A
        checkpointed micro-batch is recomputed right before its backward pass.

        Gradients accumulate into ``.grad`` as ``loss_fn(plain(input), target).backward()``
        would: the step does not zero them. Each micro-batch's loss is scaled before its
        backward pass so that the gradients are those of the whole mini-batch's loss:
        with ``reduction='mean'`` by ``micro-batch size / batch size``, with ``'sum'`` not
        at all. Gradients reach ``input`` and ``target`` too when they require grad.

        The step follows PyTorch's grad mode, as ``loss.backward()`` on the plain model
        would: it computes gradients whenever grad mode is on, in training and in eval mode
        alike (fine-tuning with dropout off and batch norm frozen is ``model.eval()`` then
        ``step``); the layers' own modes decide what dropout and batch norm do. Under
        :func:`torch.no_grad` (or :func:`torch.inference_mode`) it runs the forward passes
        and losses only, without autograd history. Micro-batches are checkpointed in
        training mode only.

        Hooks that fire once per backward pass of the plain model fire once per
        micro-batch: step the optimizer after the step returns (see :doc:`/guide`).

        If any action raises, every worker stops after its current action and the step
        raises that first exception, with its traceback. Gradients of the micro-batches
        whose backward passes had finished stay in ``.grad`` (zero them before the next
        step); deferred batch norms drop the step's statistics. The model is ready for
        the next step.

        With ``group`` (across processes), every rank calls the step with the same
        arguments: the first partition's rank uses the inputs (positional and keyword) and
        the last partition's rank ``target`` (``None``, or no input at all, is accepted
        where a value is unused), and every rank returns
        the last rank's losses. An error on any rank ends the step on every rank (the
        others raise :class:`~gpipe_core.RemotePartitionError`, told by the transport).
        With ``data_group``, the gradients are then averaged over the replicas (see
        :doc:`/distributed`).

        The step takes its input as :meth:`forward` does (``model.step(a, b, target=y,
        loss_fn=f)`` calls the first layer as ``layer(a, b)``, ``model.step(**batch,
        target=y, loss_fn=f)`` as ``layer(**batch)``), and splits ``target`` alike; for one
        input, ``model.step(x, y, f)`` is short for ``model.step(x, target=y,
        loss_fn=f)``. The step's own keywords (``target``, ``loss_fn``, ``schedule``,
        ``reduction``) are never passed to the first layer.

        Args:
            inputs: the first layer's positional arguments, at least one of them holding a
                tensor to split along dimension 0; every tensor on ``devices[0]``. Or, when
                ``target`` and ``loss_fn`` are not given by keyword, exactly three values:
                ``input, target, loss_fn``.
            keywords: the first layer's keyword arguments (every keyword but the step's
                own), split as the positional ones are.

        Keyword Args:
            target: a tensor or a tuple with the input's batch size, split alike (moved to
                ``devices[-1]`` if it is elsewhere).
            loss_fn: called as ``loss_fn(output, target)`` on each micro-batch's output
                and target (a tensor, or a tuple for a tuple); returns a scalar tensor.
            schedule: ``'gpipe'`` (every forward pass, then every backward pass),
                ``'1f1b'`` (one forward, one backward), ``'interleaved-1f1b'``,
                ``'zb-h1'`` or ``'zbv'`` (several partitions per worker, see
                ``placement``), or a :class:`~gpipe_core.Schedule`.
            reduction: how ``loss_fn`` reduces over the samples of a micro-batch:
                ``'mean'`` or ``'sum'`` (default: ``loss_fn.reduction`` when it has one,
                as the losses of :mod:`torch.nn` do, else ``'mean'``). When
                ``loss_fn`` has a ``reduction``, this must match it.

        Returns:
            The loss of each micro-batch; :meth:`Losses.reduced() <gpipe_core.Losses.reduced>`
            is the loss of the mini-batch.

        Raises:
            TypeError: the input or ``target`` holds no tensor to split or holds a tensor
                inside another value, ``loss_fn`` is not callable, ``target`` and
                ``loss_fn`` are neither both given by keyword nor passed as the second and
                third of exactly three positional arguments.
            ValueError: ``input`` is not on ``devices[0]``, ``target``'s batch size
                differs from ``input``'s, ``loss_fn`` returns a non-scalar, an unknown
                ``schedule`` or ``reduction``, or a ``reduction`` that contradicts
                ``loss_fn.reduction``.
            RuntimeError: the step is called inside a checkpointed function.

        Example:
            >>> model = GPipe(
            ...     nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
            ...     balance=[2, 1],
            ...     chunks=4,
            ... )
            >>> x, y = torch.randn(16, 4), torch.randn(16, 1)
            >>> losses = model.step(x, y, nn.MSELoss(), schedule="1f1b")
            >>> len(losses), losses.reduced().shape
            (4, torch.Size([]))
            >>> model[0].weight.grad.shape
            torch.Size([8, 4])

            Several positional inputs for the first layer:

            >>> from gpipe_core import NoChunk
            >>> class Masked(nn.Module):
            ...     def forward(self, x, mask):
            ...         return x * mask
            >>> model = GPipe(nn.Sequential(Masked(), nn.Linear(4, 1)), [1, 1], chunks=4)
            >>> mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
            >>> losses = model.step(x, NoChunk(mask), target=y, loss_fn=nn.MSELoss())
            >>> len(losses)
            4

            Keyword inputs, a dict batch's keys for instance:

            >>> batch = {"x": x, "mask": NoChunk(mask)}
            >>> len(model.step(**batch, target=y, loss_fn=nn.MSELoss()))
            4
        """
        # Across processes, the replicas of shared parameters get the sum of what the
        # step adds to their gradients, after every backward pass of the step, within
        # its run (the ranks agree on the training and grad modes, which say whether there
        # are any).
        with (
            self._config.replicas.averaging(self.parameters),
            self._run_session() as session,
        ):
            # Nothing before the run begins: an interrupt in the step (KeyboardInterrupt)
            # lands in the run, which every rank then ends.
            backward = torch.is_grad_enabled()  # in eval mode too, as autograd does
            before = self._config.shared.gradients() if backward else None
            losses = run_step(
                self._runtime,
                inputs,
                keywords,
                target,
                loss_fn,
                schedule,
                reduction,
                self._config.replicas.mean_on(self.devices),
            )
            if before is not None:
                self._config.shared.sum_gradients(before, self._placement.transport().exchange)
            if losses is not None:
                session.payload = functools.partial(to_numbers, losses)
        if losses is not None:
            return losses
        # Every rank returns the losses of the last partition's rank.
        return from_numbers(session.payloads[self.partition_ranks[-1]])

    def trace(self) -> AbstractContextManager[Timeline]:
        """Record the pipeline's tasks while the ``with`` block runs.

        Every forward pass in the block, and the backward passes of its outputs that run in
        the block too, are recorded: each task's phase, partition, micro-batch, start and
        end, thread and device. Use the :class:`~gpipe_core.Timeline` after the block (CUDA
        times are resolved when it exits). Outside such a block, nothing is recorded and
        nothing is added to the autograd graph.

        Raises:
            RuntimeError: the module is already being traced.

        Example:
            >>> model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), [1, 1], chunks=4)
            >>> with model.trace() as timeline:
            ...     model(torch.randn(8, 4, device=model.devices[0])).sum().backward()
            >>> timeline.summary().theoretical_bubble  # (n - 1) / (m + n - 1)
            0.2
            >>> timeline.to_chrome_trace("trace.json")  # doctest: +SKIP
        """
        return record(self, self.devices)

    def extra_repr(self) -> str:
        devices = [str(device) for device in self.devices]
        return (
            f"balance={self.balance}, devices={devices}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
        )
