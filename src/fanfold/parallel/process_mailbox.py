"""The process engine's mailboxes: one per worker, one message each way, handed over in shared memory with futexes.

The caller and a worker alternate strictly (the caller posts a request, the worker answers it, and neither posts
again before it has read the other's message), so one small block of shared memory per worker is enough: a counter
of the messages each side has posted (each on a cache line of its own), a stop word, the two messages' lengths, and
an area for each side's message. A step's repeated messages cross in a compact form (``process_messages.Codec``);
any other message is pickled with multiprocessing's ``ForkingPickler``, so that what must
still cross as a file descriptor (a new slot buffer, a tensor that is not plain) does so through torch's reductions;
a message too big for its area is spilled into a fresh shared buffer whose descriptor crosses instead.

Waiting: some microseconds of polling the peer's counter (its answer is often that close), then sleeping in the
kernel on it (futex: no CPU taken from the processes that compute), waking every 50 ms to run a check (is the peer's
process still there?) and to look at the stop word and the deadline. A pipe round trip costs two system calls and
a poll() per message; a futex hand-off costs a store and one wake-up call, and none when the peer is already there.
The block is file-descriptor backed (``_core.shm.shared_bytes``): nothing named is left in /dev/shm; the futex
waits are ``_core.shm.Futex``'s, the same as the shared-memory transport's.
Layer: ``_core.shm``, ``process_slots`` <- ``process_mailbox`` <- ``process_worker`` <- ``process_engine``.
"""
from __future__ import annotations

import ctypes
import io
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (torch's reductions: the pickler below must know them)

from .._core.buffers import bytes_to_tensor, tensor_to_bytes
from .._core.shm import Futex, shared_bytes
from .process_messages import Codec

CALLER, WORKER = 0, 1
_COUNTER = (0, 64)  # byte offset of each side's counter: cache lines of their own
_STOP = 128
_LENGTH = (192, 200)  # int64: the length of each side's current message
_HEADER = 4096
_AREA = 1 << 16  # bytes per side's message area; bigger messages are spilled
_PICKLE = pickle.PROTO[0]  # the first byte of every pickle this side makes (protocol 2 and up)


@dataclass
class _Spill:
    """A message too big for its area: its pickled bytes, in a shared buffer of their own."""

    data: torch.Tensor


class Stopped(Exception):
    """The caller has set the stop word (raised in the worker's wait)."""


class Mailbox:
    """One side (``CALLER`` or ``WORKER``) of one worker's block. The caller makes the block (``Mailbox()``) and
    passes ``block`` to the worker, which opens its side with ``Mailbox(block, WORKER)``."""

    def __init__(self, block: torch.Tensor | None = None, side: int = CALLER) -> None:
        self._futex = Futex("DataParallel(engine='process')")
        self.block = shared_bytes(_HEADER + 2 * _AREA).zero_() if block is None else block
        self.side = side
        self._base = self.block.data_ptr()
        self._mine = ctypes.c_uint32.from_address(self._base + _COUNTER[side])
        self._theirs = ctypes.c_uint32.from_address(self._base + _COUNTER[1 - side])
        self._stop = ctypes.c_uint32.from_address(self._base + _STOP)
        self._lengths = [ctypes.c_int64.from_address(self._base + at) for at in _LENGTH]
        # one pickler for every message: ForkingPickler.dumps would copy its dispatch table each time
        self._buffer = io.BytesIO()
        self._pickler = ForkingPickler(self._buffer, pickle.HIGHEST_PROTOCOL)
        self._codec = Codec()  # a training loop's repeated step messages cross as a few bytes, unpickled
        self._mine_address = ctypes.addressof(self._mine)
        self.posted = 0  # messages this side has posted
        self.read = 0  # messages of the other side this side has read

    def send(self, message: Any) -> None:
        """Post ``message`` (the other side must have read the previous one: the protocol alternates)."""
        data = self._codec.encode(message)
        if data is None:
            data = self._pickle(message)
            if len(data) > _AREA:
                data = self._pickle(_Spill(bytes_to_tensor(data).share_memory_()))
            self._codec.sent(message)  # pickled: the receiver will have it
        ctypes.memmove(self._base + _HEADER + self.side * _AREA, data, len(data))
        self._lengths[self.side].value = len(data)
        self.posted += 1
        self._mine.value = self.posted & 0xFFFFFFFF
        self._futex.wake(self._mine_address, 1)

    def _pickle(self, message: Any) -> bytes:
        self._buffer.seek(0)
        self._buffer.truncate()
        self._pickler.clear_memo()
        self._pickler.dump(message)
        return self._buffer.getvalue()

    def ready(self) -> bool:
        """Whether the other side has posted a message this side has not read (no waiting)."""
        return (self._theirs.value - ((self.read + 1) & 0xFFFFFFFF)) & 0x80000000 == 0

    def receive(self, check: Callable[[], None], deadline: float | None = None) -> Any:
        """The other side's next message. Waits for it; ``check()`` runs every 50 ms while waiting (it raises to give
        up, e.g. when the peer's process is gone). Raises ``TimeoutError`` after ``deadline`` (``time.monotonic()``)
        and, in the worker, ``Stopped`` once the caller has set the stop word."""
        self.wait(check, deadline)
        self.read += 1
        n = self._lengths[1 - self.side].value
        data = ctypes.string_at(self._base + _HEADER + (1 - self.side) * _AREA, n)
        if data[0] != _PICKLE:
            return self._codec.decode(data)
        message = pickle.loads(data)
        if isinstance(message, _Spill):
            message = pickle.loads(tensor_to_bytes(message.data))
        self._codec.got(message)
        return message

    def wait(self, check: Callable[[], None], deadline: float | None = None) -> None:
        """Wait until ``ready()``; see ``receive``. Polls without yielding the core (on a busy machine a yield gives
        away a whole time slice), then sleeps on the other side's counter."""
        if self.ready():
            return
        target = (self.read + 1) & 0xFFFFFFFF

        def between() -> None:
            if self.side == WORKER and self._stop.value:
                raise Stopped
            if self.ready():
                return
            check()  # the peer may be gone
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError

        self._futex.wait(self._theirs, lambda v: (v - target) & 0x80000000 == 0, between, yield_core=False)

    def stop(self) -> None:
        """(Caller) set the stop word and wake the worker: it leaves its wait for the next request."""
        self._stop.value = 1
        self._futex.wake(self._base + _COUNTER[CALLER], 1)
