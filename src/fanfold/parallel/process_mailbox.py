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
The block is file-descriptor backed (``share_memory_()``): nothing named is left in /dev/shm. Linux only; as
``collectives.shm.segment``, it relies on stores becoming visible in program order (x86-64): a peer that sees the
counter also sees the message written before it.
Layer: ``process_slots`` <- ``process_mailbox`` <- ``process_worker`` <- ``process_engine``.
"""
from __future__ import annotations

import ctypes
import io
import pickle
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (torch's reductions: the pickler below must know them)

from .._core.buffers import bytes_to_tensor, tensor_to_bytes
from .process_messages import Codec
from .process_slots import shared_bytes

CALLER, WORKER = 0, 1
_COUNTER = (0, 64)  # byte offset of each side's counter: cache lines of their own
_STOP = 128
_LENGTH = (192, 200)  # int64: the length of each side's current message
_HEADER = 4096
_AREA = 1 << 16  # bytes per side's message area; bigger messages are spilled
_SPIN_S = 100e-6  # polling the peer's counter before sleeping (as collectives.shm.segment)
_SLICE_S = 0.05
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_PICKLE = pickle.PROTO[0]  # the first byte of every pickle this side makes (protocol 2 and up)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).syscall  # CDLL: the interpreter lock is released during the call
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_long]
    return fn


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
        if _SYS_FUTEX is None:
            raise RuntimeError(f"DataParallel(engine='process') needs Linux futexes; machine {platform.machine()!r} "
                               "is not known")
        self.block = shared_bytes(_HEADER + 2 * _AREA).zero_() if block is None else block
        self.side = side
        self._base = self.block.data_ptr()
        self._mine = ctypes.c_uint32.from_address(self._base + _COUNTER[side])
        self._theirs = ctypes.c_uint32.from_address(self._base + _COUNTER[1 - side])
        self._stop = ctypes.c_uint32.from_address(self._base + _STOP)
        self._lengths = [ctypes.c_int64.from_address(self._base + at) for at in _LENGTH]
        self._futex = _syscall()
        # one pickler for every message: ForkingPickler.dumps would copy its dispatch table each time
        self._buffer = io.BytesIO()
        self._pickler = ForkingPickler(self._buffer, pickle.HIGHEST_PROTOCOL)
        self._timespec = _Timespec(0, int(_SLICE_S * 1e9))
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
        self._futex(_SYS_FUTEX, self._mine_address, _FUTEX_WAKE, 1, None, None, 0)

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
        """Wait until ``ready()``; see ``receive``."""
        if self.ready():
            return
        spin_end = time.perf_counter() + _SPIN_S
        while time.perf_counter() < spin_end:  # no sched_yield(): on a busy machine it gives away a whole slice
            if self.ready():
                return
        address = ctypes.addressof(self._theirs)
        while True:
            if self.side == WORKER and self._stop.value:
                raise Stopped
            seen = self._theirs.value
            if self.ready():
                return
            self._futex(_SYS_FUTEX, address, _FUTEX_WAIT, seen, ctypes.addressof(self._timespec), None, 0)
            if self.ready():
                return
            check()  # woken by the slice's end (or a signal): the peer may be gone
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError

    def stop(self) -> None:
        """(Caller) set the stop word and wake the worker: it leaves its wait for the next request."""
        self._stop.value = 1
        self._futex(_SYS_FUTEX, self._base + _COUNTER[CALLER], _FUTEX_WAKE, 1, None, None, 0)
