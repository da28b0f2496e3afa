"""The process engine's messages (small dataclasses) and its mailboxes: one per worker, one message each way, in a
block of fd-backed shared memory woken through ``_core.shm.Futex``. A step's repeated messages cross as a few bytes
(:class:`Codec`); anything else is pickled with ``ForkingPickler``, spilled into a shared buffer when too big.
"""
from __future__ import annotations

import ctypes
import io
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (torch's reductions: the pickler below must know them)

from .._core.shm import Futex, shared_bytes
from .._core.tree import Spec
from .process_slots import Slot


@dataclass
class Forward:
    step: int
    leaves: list  # the replica's flattened (args, kwargs), tensors detached
    spec: Spec
    differentiable: list[int]  # positions in ``leaves`` whose gradient the caller wants
    grad: bool  # the caller's grad mode
    training: list[bool]  # module.training of every submodule, in modules() order
    release: list[int] = field(default_factory=list)  # steps whose graph the caller has dropped
    arena: torch.Tensor | None = None  # the caller's slot buffer for this worker, when new


@dataclass
class Backward:
    step: int
    grads: list  # one per output tensor (its Slot), None where the caller has none
    arena: torch.Tensor | None = None


@dataclass
class Ready:
    index: int
    pid: int


@dataclass
class Outputs:
    leaves: list  # the output flattened, tensors as Slots of the worker's buffer
    spec: Spec
    arena: torch.Tensor | None = None  # the worker's slot buffer, when new


@dataclass
class Gradients:
    # per parameter that requires grad: True where its gradient slot holds it, None where unused, or the gradient
    # itself where it is not dense (sparse: nn.Embedding(sparse=True)), pickled
    parameters: list
    inputs: list  # one per ``Forward.differentiable`` position: a Slot, or None
    arena: torch.Tensor | None = None


@dataclass
class Failure:
    index: int
    kind: str  # the exception's type name
    message: str
    traceback: str


_TAGS = {Forward: 1, Backward: 2, Outputs: 3, Gradients: 4}
_FORWARD = struct.Struct("<BqBI")  # tag, step, grad, number of released steps (then one int64 each)
_BACKWARD = struct.Struct("<Bq")  # tag, step
_RELEASED = struct.Struct("<q")
_SCALARS = (Slot, type(None), bool, int, float, str)  # leaves that are the same value when they are the same object


def _plain_spec(spec: Spec) -> bool:
    """Whether ``spec`` compares by value: no instance kept as a template (a dataclass, a dict subclass)."""
    return all(node.template is None or isinstance(node.template, type) for node in spec.nodes)


def _scalars(leaves: list) -> bool:
    return all(type(v) in _SCALARS for v in leaves)


def _same(leaves: list, last: list) -> bool:
    return len(leaves) == len(last) and all(a is b for a, b in zip(leaves, last))


def _repeats(msg: Any, last: Any) -> bool:
    """Whether ``msg`` has the structure of ``last`` (a template: checked by ``_template``), its numbers aside."""
    if msg.arena is not None:
        return False
    if type(msg) is Forward:
        return (_same(msg.leaves, last.leaves) and msg.training == last.training
                and msg.differentiable == last.differentiable and msg.spec == last.spec)
    if type(msg) is Outputs:
        return _same(msg.leaves, last.leaves) and msg.spec == last.spec
    if type(msg) is Backward:
        return _same(msg.grads, last.grads)
    return _same(msg.inputs, last.inputs) and msg.parameters == last.parameters


def _template(msg: Any) -> bool:
    """Whether later messages may repeat ``msg``: its leaves and spec compare by identity and value."""
    if type(msg) in (Forward, Outputs):
        return _scalars(msg.leaves) and _plain_spec(msg.spec)
    if type(msg) is Backward:
        return _scalars(msg.grads)
    return _scalars(msg.inputs) and all(p is True or p is None for p in msg.parameters)


class Codec:
    """One mailbox side's memory of the last full message of each kind, sent and received."""

    def __init__(self) -> None:
        self._sent: dict[type, Any] = {}
        self._got: dict[type, Any] = {}

    def encode(self, msg: Any) -> bytes | None:
        """``msg`` in compact form when it repeats the last one of its kind sent, else None (pickle it)."""
        last = self._sent.get(type(msg))
        if last is None or not _repeats(msg, last):
            return None
        if type(msg) is Forward:
            return _FORWARD.pack(1, msg.step, msg.grad, len(msg.release)) + b"".join(
                _RELEASED.pack(s) for s in msg.release)
        if type(msg) is Backward:
            return _BACKWARD.pack(2, msg.step)
        return bytes((_TAGS[type(msg)],))

    def sent(self, msg: Any) -> None:
        """``msg`` was posted in full: it is the template of its kind from now on (or none, if it cannot be one)."""
        if type(msg) in _TAGS:
            self._sent[type(msg)] = msg if _template(msg) else None

    def got(self, msg: Any) -> None:
        """``msg`` was received in full: the receiver's template of its kind."""
        if type(msg) in _TAGS:
            self._got[type(msg)] = msg

    def decode(self, data: bytes) -> Any:
        """The message a compact ``data`` stands for."""
        tag = data[0]
        if tag == 1:
            _, step, grad, n = _FORWARD.unpack_from(data)
            t = self._got[Forward]
            release = [_RELEASED.unpack_from(data, _FORWARD.size + 8 * k)[0] for k in range(n)]
            return Forward(step, t.leaves, t.spec, t.differentiable, bool(grad), t.training, release)
        if tag == 2:
            t = self._got[Backward]
            return Backward(_BACKWARD.unpack_from(data)[1], t.grads)
        if tag == 3:
            t = self._got[Outputs]
            return Outputs(t.leaves, t.spec)
        t = self._got[Gradients]
        return Gradients(t.parameters, t.inputs)


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
                data = self._pickle(_Spill(torch.frombuffer(bytearray(data), dtype=torch.uint8).share_memory_()))
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
            message = pickle.loads(ctypes.string_at(message.data.data_ptr(), message.data.numel()))
        self._codec.got(message)
        return message

    def wait(self, check: Callable[[], None], deadline: float | None = None) -> None:
        """Wait until ``ready()``; see ``receive``. Polls without yielding the core (on a busy machine a yield gives
        away a whole time slice), then sleeps on the other side's counter."""
        if self.ready():
            return
        target = (self.read + 1) & 0xFFFFFFFF
        slept = []  # check() runs only once a sleep has ended without the message: a peer gone is rare

        def between() -> None:
            if self.side == WORKER and self._stop.value:
                raise Stopped
            if slept:
                check()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError
            slept.append(True)

        self._futex.wait(self._theirs, lambda v: (v - target) & 0x80000000 == 0, between, yield_core=False)

    def stop(self) -> None:
        """(Caller) set the stop word and wake the worker: it leaves its wait for the next request."""
        self._stop.value = 1
        self._futex.wake(self._base + _COUNTER[CALLER], 1)
