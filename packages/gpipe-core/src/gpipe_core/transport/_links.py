"""The point-to-point side of :class:`~gpipe_core.transport._distributed.DistributedTransport`:
how a message is posted to a peer (in the pieces :mod:`gpipe_core.transport._wire` lays
out, in order, on the pipeline's tags), how a run's sends are waited for at its end, and how
a peer's headers are received with receives posted ahead.

This module knows nothing of runs' lifecycles, mailboxes or failures beyond a peer that is
gone: :class:`Links` is the part of the transport's state and methods that touch the wire.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain, repeat

import torch
import torch.distributed as dist
from torch import Tensor

from . import _wire
from ._groups import Carrier
from ._payloads import Payloads
from ._wire import Meta

__all__ = ["Links"]


class Links:
    """Messages to and from each peer on the wire; a base of
    :class:`~gpipe_core.transport._distributed.DistributedTransport`, which sets every
    attribute below in its constructor."""

    rank: int
    tag: int
    run: int
    payloads: Payloads
    #: The group of the messages to each peer, and of those from it.
    to_peer: dict[int, Carrier | None]
    from_peer: dict[int, Carrier | None]
    cond: threading.Condition
    #: The peers gone, and why (under ``cond``).
    dead: dict[int, str]
    send_locks: dict[int, threading.Lock]
    #: This run's sends not waited for yet (under ``sends_lock``).
    sends: list[tuple[int, dist.Work, Tensor]]
    sends_lock: threading.Lock
    #: Each peer's receives posted ahead, oldest first (its receiver thread's).
    headers: dict[int, deque[tuple[dist.Work, bytearray, Tensor]]]
    #: The sizes of the buffers posted for the messages to each peer, and from it.
    sent: dict[int, _wire.Capacity]
    received: dict[int, _wire.Capacity]

    def _post(self, peer: int, meta: Meta, tensors: Sequence[Tensor]) -> None:
        """Send a message to ``peer``: in one piece when it fits the buffer posted for it,
        else its header, then what does not fit in it."""
        strict = self.payloads.strict
        # On the strict channel, the tensors travel apart from the header, on their device.
        data = [] if strict else [_wire.as_bytes(tensor) for tensor in tensors]
        payloads = self.payloads.outgoing(tensors) if strict else []
        specs = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
        encoded = pickle.dumps((self.run, meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
        whole = _wire.whole(len(encoded), [len(chunk) for chunk in data])
        carrier = self.to_peer[peer]
        assert carrier is not None  # a peer: the group has two ranks or more
        with self.send_locks[peer]:  # the messages' order: the sizes of their buffers
            capacity = self.sent[peer]
            parts = _wire.message(encoded, data, capacity.size, channel=strict and bool(tensors))
            counted = capacity.counted(whole)
            # The header on the pipeline's tag, what does not fit in it on the next one.
            tags = [self.tag] + [self.tag + 1] * (len(parts) - 1)
            # Each part sent, and recorded for the end of the run, by C calls only; on the
            # strict channel, the tensors' payloads right after (in the headers' order).
            sending: Iterable[tuple[int, dist.Work, Tensor]] = zip(
                repeat(peer), map(carrier.send, [[p] for p in parts], repeat(peer), tags), parts
            )
            if payloads:
                posting = self.payloads.sending(peer, payloads)
                sending = chain(sending, zip(repeat(peer), posting, payloads))
            expected = len(parts) + len(payloads)
            with self.sends_lock:
                start = len(self.sends)
                try:
                    # An interrupt (KeyboardInterrupt) lands between Python instructions: it
                    # finds the message counted and sent whole, or neither.
                    self.sent[peer] = counted
                    self.sends.extend(sending)
                    self.payloads.count_sent(peer, len(payloads))
                except RuntimeError as error:  # the connection is closed
                    with self.cond:
                        self.dead.setdefault(peer, f"{type(error).__name__}: {error}")
                    raise RuntimeError(
                        f"rank {self.rank} cannot send to rank {peer}, which died or left the "
                        f"group ({error})"
                    ) from error
                except BaseException:
                    sent = len(self.sends) - start
                    if sent != (expected if self.sent[peer] is counted else 0):
                        with self.cond:  # the peer cannot read what would follow
                            self.dead.setdefault(peer, "a message to it was interrupted half-sent")
                    raise

    def _post_if_alive(self, peer: int, meta: Meta) -> None:
        """Send a message without tensors to ``peer`` unless it is gone (a dead peer is
        recorded, and its receiver thread here reports it)."""
        if peer in self.dead:
            return
        with contextlib.suppress(RuntimeError):
            self._post(peer, meta, [])

    def _drain_sends(self, deadlines: dict[int, float | None]) -> None:
        """Wait until this run's sends have been received, their peer is gone, or the
        peer's deadline has passed (then the peer counts as gone: gloo closes a
        connection whose wait timed out)."""
        with self.sends_lock:
            sends, self.sends = self.sends, []
        sends.reverse()  # drained from the end: what is left is kept if interrupted
        try:
            while sends:
                peer, work, _ = sends[-1]
                if peer not in self.dead:
                    self._wait_sent(peer, work, deadlines[peer])
                sends.pop()
        finally:
            # Interrupted (KeyboardInterrupt): the next run waits for the sends not waited
            # for yet (a wait that returned counts the send's completion: gloo's next wait
            # on it would wait for another).
            left = [send for send in reversed(sends) if not send[1].is_completed()]
            if left:
                with self.sends_lock:
                    self.sends[:0] = left

    def _wait_sent(self, peer: int, work: dist.Work, deadline: float | None) -> None:
        """Wait until a send to ``peer`` has been received, or until ``deadline``."""
        try:
            self.payloads.wait_sent(work, deadline)
        except RuntimeError as error:
            with self.cond:
                # The receiver thread may have said so already (the peer died).
                self.dead.setdefault(peer, f"{type(error).__name__}: {error}")
                self.cond.notify_all()

    def _next_header(self, peer: int) -> tuple[bytearray, Tensor]:
        """``peer``'s next message (or its header), with :data:`_wire.HEADERS_AHEAD` receives
        posted ahead of it (each into a buffer of its own, of the size
        :class:`_wire.Capacity` agrees on: the tensors inline in a message are views of it)."""
        posted = self.headers[peer]
        while len(posted) < _wire.HEADERS_AHEAD:
            raw = bytearray(self.received[peer].size)
            header = torch.frombuffer(raw, dtype=torch.uint8)
            carrier = self.from_peer[peer]
            assert carrier is not None  # a peer: the group has two ranks or more
            work = carrier.recv([header], peer, self.tag)
            posted.append((work, raw, header))
        work, raw, header = posted[0]
        work.wait()
        posted.popleft()
        return raw, header

    def _recv(self, tensor: Tensor, peer: int) -> None:
        """Receive the next payload (or metadata that did not fit in its header)."""
        carrier = self.from_peer[peer]
        assert carrier is not None  # a peer: the group has two ranks or more
        carrier.recv([tensor], peer, self.tag + 1).wait()
