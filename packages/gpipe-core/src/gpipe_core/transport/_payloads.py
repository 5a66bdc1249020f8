"""The channel of a pipeline's payloads across processes: tagged, strict, or NCCL.

Between two ranks, :class:`~gpipe_core.transport._distributed.DistributedTransport` sends every
message as a header on the pipeline's gloo groups (what the message is, its tensors' dtypes and
shapes). Where the message's tensors go is this module's choice, one :class:`Payloads` per
pipeline:

- ``"tagged"`` (the default on gloo): in the header when they fit the buffer posted for it,
  else in a second piece on the pipeline's second tag, into a buffer that may be larger.
- ``"strict"`` (on gloo, with the environment variable :data:`STRICT_ENV` set to ``1``): never
  in the header; each tensor of a message travels as one payload of exactly its bytes, on one
  fixed tag, posted by the sender right after the header under the same lock (so the
  payloads between two ranks come in the order of their headers), received by the peer's
  receiver thread in the order of the headers it reads, each into a buffer of exactly the
  size the header gives. That is the protocol NCCL needs (it matches sends and receives
  between two ranks in the order they are posted, ignores tags, and needs a receive of the
  size sent), run on gloo so that the CPU tests check it.
- ``"nccl"``: the strict protocol on NCCL, when the pipeline's group has an NCCL backend and
  every rank's partitions are on one CUDA device each (the ranks agree on it while the
  pipeline is built): payloads go from the partition's device to the peer's device, with no
  host copy, on two NCCL groups of the pipeline's ranks (one per direction, so that a send
  waiting for its receive in one direction never holds up the other).

A failure never leaves a payload posted without its match: a receiver thread reads every
header its peer sent until the peer's message that ends the run, and receives every payload
a header announces, whether the run still goes on here or not; a sender posts a message's
payloads right after its header, and waits for its sends at the end of every run.

It knows nothing of messages or runs: it moves tensors between two ranks, in order.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ._groups import GLOO_TIMEOUT, Carrier, Connections

__all__ = ["STRICT_ENV", "Payloads", "choose_payloads"]

#: The environment variable that picks the strict payload channel on gloo (``1``).
STRICT_ENV = "GPIPE_STRICT_PAYLOADS"
#: The modes of :class:`Payloads`.
MODES = ("tagged", "strict", "nccl")


def strict_requested() -> bool:
    """Whether :data:`STRICT_ENV` asks for the strict payload channel."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _flat(tensor: Tensor) -> Tensor:
    """``tensor``'s bytes as a flat uint8 tensor, on its device (a view when contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _host_bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s bytes as a flat uint8 tensor on the CPU."""
    return _flat(tensor.detach().to("cpu"))


_Specs = Sequence[tuple[torch.dtype, tuple[int, ...]]]
_Peers = dict[int, Carrier | None]


class Payloads:
    """How the tensors of a pipeline's messages travel between two of its ranks.

    Args:
        mode: one of :data:`MODES`.
        to_peer: the group of the payloads to each peer (gloo's: the headers' groups;
            NCCL's: its own).
        from_peer: the group of the payloads from each peer.
        tag: the one tag of the payloads.
        device: where the NCCL payloads are sent from and received into (``"nccl"`` only).
    """

    def __init__(
        self,
        mode: str,
        to_peer: dict[int, Carrier | None],
        from_peer: dict[int, Carrier | None],
        tag: int,
        device: torch.device | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (mode: {mode!r})")
        self.mode = mode
        self.to_peer = to_peer
        self.from_peer = from_peer
        self.tag = tag
        self.device = device
        #: Payload receives posted and not completed yet.
        self.receiving = 0
        #: How many payloads were sent to each peer, and received from it (every one a
        #: header announced, failed runs included: the counts of two peers agree once a run
        #: ended on both).
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self._stream: Any = None  # the NCCL receives' side stream, made on first use

    @property
    def strict(self) -> bool:
        """Whether every tensor travels as a payload of its exact size (never inline)."""
        return self.mode != "tagged"

    # -- sending -------------------------------------------------------------------------

    def outgoing(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The payloads of a message's ``tensors``, ready to send (flat bytes; on NCCL on
        :attr:`device`, copied on the current stream if need be, else on the CPU). Empty
        tensors have none (the peer derives the same from the header)."""
        if self.mode != "nccl":
            return [_host_bytes(tensor) for tensor in tensors if tensor.numel()]
        device = self._nccl_device()
        return [_nccl_outgoing(tensor, device) for tensor in tensors if tensor.numel()]

    def sending(self, peer: int, payloads: Sequence[Tensor]) -> Iterator[dist.Work]:
        """Post ``payloads`` (from :meth:`outgoing`) to ``peer`` in order, each as the
        iterator is consumed, by C calls only (an interrupt lands before or after a send,
        not inside one); the caller keeps each payload alive until its send is done, and
        counts them (:meth:`count_sent`)."""
        carrier = self.to_peer[peer]
        assert carrier is not None  # a peer: the group has two ranks or more
        return map(carrier.send, [[data] for data in payloads], repeat(peer), repeat(self.tag))

    def count_sent(self, peer: int, count: int) -> None:
        """Count ``count`` payloads sent to ``peer``."""
        if count:
            self.sent[peer] = self.sent.get(peer, 0) + count

    # -- receiving -----------------------------------------------------------------------

    def receive(self, peer: int, specs: _Specs) -> list[Tensor]:
        """Receive the payloads of one message from ``peer``, whose header gave ``specs``
        (each tensor's dtype and shape), in order, each of exactly its size; wait until
        they are there. On NCCL they are on :attr:`device`, else on the CPU."""
        device = self._nccl_device() if self.mode == "nccl" else torch.device("cpu")
        carrier = self.from_peer[peer]
        assert carrier is not None  # a peer: the group has two ranks or more
        tensors = []
        for dtype, shape in specs:
            if self.mode == "nccl":
                tensor = _nccl_receive(carrier, peer, self.tag, dtype, shape, device, self)
            else:
                tensor = torch.empty(shape, dtype=dtype)
                if tensor.numel():
                    self.receiving += 1
                    try:
                        carrier.recv([_flat(tensor)], peer, self.tag).wait()
                    finally:
                        self.receiving -= 1
            if tensor.numel():
                self.received[peer] = self.received.get(peer, 0) + 1
            tensors.append(tensor)
        return tensors

    # -- waiting -------------------------------------------------------------------------

    def wait_sent(self, work: dist.Work, deadline: float | None) -> None:
        """Wait until a send is done, or until ``deadline`` (monotonic; None: no bound).

        Raises:
            RuntimeError: the send failed, or it was not done by ``deadline``.
        """
        if self.mode != "nccl":
            if deadline is None:
                work.wait()
            else:
                remaining = max(deadline - time.monotonic(), 0.001)
                work.wait(datetime.timedelta(seconds=remaining))
            return
        # NCCL's wait() only orders the current stream after the send: poll its completion.
        pause = 0.0001
        while not work.is_completed():
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError("the send was not received in time")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def _nccl_device(self) -> torch.device:
        assert self.device is not None, "an NCCL channel has a device"
        return self.device


# -- NCCL ------------------------------------------------------------------------------------
# Not run by the tests (they have no GPU, and NCCL refuses two ranks on one device): it
# shares everything else (the order, the sizes, the one tag, the failures) with the strict
# mode on gloo, which they run.


def _nccl_outgoing(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor``'s bytes on ``device``, to be sent by NCCL: a view when it is there
    already and contiguous, else a copy on the current stream (which the send waits for)."""
    return _flat(tensor.detach().to(device))


def _nccl_receive(
    carrier: Carrier,
    peer: int,
    tag: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    device: torch.device,
    payloads: Payloads,
) -> Tensor:
    """Receive one tensor from ``peer`` into a new tensor on ``device``, and wait (on the
    host) until it is there: any stream may use it then. The caller that hands it to
    another stream records that stream on it (``record_stream``)."""
    with torch.cuda.device(device):
        if payloads._stream is None:
            payloads._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream = payloads._stream
        with torch.cuda.stream(stream):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if tensor.numel() == 0:
                return tensor
            payloads.receiving += 1
            try:
                work = carrier.recv([_flat(tensor)], peer, tag)
                work.wait()  # the side stream waits for NCCL's
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
                done.synchronize()
            finally:
                payloads.receiving -= 1
    return tensor


def _nccl_groups(
    group: dist.ProcessGroup, tag: int, timeout: float | None
) -> tuple[Carrier, Carrier | None]:
    """Two NCCL groups of ``group``'s ranks (to higher ranks, to lower ones), made on every
    rank together from the default store, named like the gloo ones."""
    ranks = dist.get_process_group_ranks(group)
    me, size = group.rank(), group.size()
    name = f"gpipe/{'-'.join(map(str, ranks))}/{tag}/payloads"
    store = dist.distributed_c10d._get_default_store()
    nccl = cast(Any, dist).ProcessGroupNCCL
    options = nccl.Options()
    options._timeout = datetime.timedelta(seconds=max(GLOO_TIMEOUT, timeout or 0.0))

    def make(direction: str) -> Carrier:
        prefixed = dist.distributed_c10d.PrefixStore(f"{name}/{direction}/", store)
        return cast(Carrier, nccl(prefixed, me, size, options))

    return make("higher"), make("lower") if size > 1 else None


def _has_nccl(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s backend has NCCL (``'nccl'``, ``'cpu:gloo,cuda:nccl'``)."""
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False


def _nccl_here(devices: Sequence[torch.device]) -> bool:
    """Whether this rank can carry payloads on NCCL: torch has it, and this rank's
    partitions are all on one CUDA device."""
    if not dist.is_nccl_available() or not hasattr(dist, "ProcessGroupNCCL"):
        return False
    return len(set(devices)) == 1 and devices[0].type == "cuda"


def _agree(group: dist.ProcessGroup, tag: int, mine: bool, timeout: float | None) -> bool:
    """Whether every rank of ``group`` said ``mine`` (through the default store)."""
    ranks = dist.get_process_group_ranks(group)
    me, size = group.rank(), group.size()
    name = f"gpipe/{'-'.join(map(str, ranks))}/{tag}/nccl"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{name}/{me}", "1" if mine else "0")
    keys = [f"{name}/{rank}" for rank in range(size)]
    bound = datetime.timedelta(seconds=max(GLOO_TIMEOUT, timeout or 0.0))
    store.wait(keys, bound)
    return all(store.get(key) == b"1" for key in keys)


def choose_payloads(
    group: dist.ProcessGroup,
    connections: Connections,
    tag: int,
    devices: Sequence[torch.device],
    timeout: float | None,
) -> Payloads:
    """The payload channel of the pipeline ``tag`` on ``group`` (collective: every rank of
    ``group`` calls it while the pipeline is built): NCCL where every rank can carry them
    there, else strict on gloo where :data:`STRICT_ENV` asks for it, else tagged.

    ``devices`` are this rank's partitions' devices; ``connections`` the pipeline's gloo
    groups (see :func:`~gpipe_core.transport._groups.connect`).
    """
    higher, lower = connections
    me = group.rank()
    size = higher.size()

    def directions(up: Carrier, down: Carrier | None) -> tuple[_Peers, _Peers]:
        to_peer: _Peers = {peer: up if peer > me else down for peer in range(size)}
        from_peer: _Peers = {peer: up if peer < me else down for peer in range(size)}
        return to_peer, from_peer

    # The group's backend is the same on every rank: they all agree, or none does.
    if _has_nccl(group) and size > 1 and _agree(group, tag, _nccl_here(devices), timeout):
        up, down = _nccl_groups(group, tag, timeout)
        return Payloads("nccl", *directions(up, down), tag=0, device=devices[0])
    mode = "strict" if strict_requested() else "tagged"
    return Payloads(mode, *directions(higher, lower), tag=tag + 1)
