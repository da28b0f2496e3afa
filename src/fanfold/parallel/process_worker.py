"""One replica of ``DataParallel(..., engine="process")`` in its own process, and the wire to it: the shared-memory
slots that carry a message's tensors, the messages (small dataclasses), the mailbox (one message each way in a
block of shared memory woken through ``_core.shm.Futex``; a step's repeated messages cross as a few bytes), the
worker's loop, and the forward and backward steps that the caller also runs for replica 0.
"""
from __future__ import annotations

import ctypes
import io
import math
import os
import pickle
import signal
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (torch's reductions: the pickler below must know them)
from torch import nn

from .._core.shm import Futex, alive, shared_bytes
from .._core.tree import Spec, flatten, unflatten
from .parallel_backward import _alias_parameters, _tensor, _with_tensor

ALIGN = 64  # bytes: every slot starts on a cache line, so any dtype's view of the byte buffer is aligned


@dataclass(frozen=True)
class Slot:
    """Where one dense tensor lies in a byte buffer; ``stride`` keeps its memory format (channels_last, say)."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """The strides the receiver gets: ``t``'s where its layout is dense in some order of the dims (channels_last, a
    transpose), else the dense layout ``torch.empty_like`` gives it."""
    return tuple(t.stride()) if t.is_contiguous() else tuple(torch.empty_like(t, device="meta").stride())


def _plain(value: Any) -> bool:
    return (type(value) is torch.Tensor and value.layout == torch.strided and value.device.type == "cpu"
            and not value.is_quantized)


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[Slot], int]:
    """One slot per tensor, packed in order; and the bytes they take in all."""
    slots, size = [], 0
    for t in tensors:
        slots.append(Slot(size, tuple(t.shape), t.dtype, dense_stride(t)))
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return slots, size


def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, as a view of ``buffer`` (no copy)."""
    nbytes = math.prod(slot.shape) * slot.dtype.itemsize
    return buffer[slot.offset:slot.offset + nbytes].view(slot.dtype).as_strided(slot.shape, slot.stride)


class Arena:
    """One direction's buffer for one worker; it grows, and must then be sent again, only when a step needs more.
    The slots and their views are kept per structure (the shapes and dtypes of one pack's tensors), so that a loop
    alternating forward and backward messages gets the same ``Slot`` objects each step (the mailbox sends
    a message whose slots are the last one's in compact form). Every layout starts at offset 0: only one message
    per direction is in flight, and its receiver reads (or copies) it before answering."""

    _KEEP = 8  # layouts kept; more distinct structures than this are laid out again

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._layouts: dict[tuple, tuple[list[Slot], list[torch.Tensor]]] = {}

    def pack(self, leaves: Sequence[Any]) -> tuple[list, torch.Tensor | None]:
        """``leaves`` with each plain tensor copied into the buffer and replaced by its Slot; the new buffer if the
        old one was too small, else None."""
        found = [(k, v) for k, v in enumerate(leaves) if _plain(v)]
        key = tuple((t.shape, t.dtype, dense_stride(t)) for _, t in found)
        grown = None
        known = self._layouts.get(key)
        if known is None:
            slots, size = layout([t for _, t in found])
            if size > self.buffer.numel():
                self.buffer = grown = shared_bytes(max(size, 2 * self.buffer.numel()))
                self._layouts.clear()  # their views are of the old buffer
            if len(self._layouts) >= self._KEEP:
                self._layouts.clear()
            known = self._layouts[key] = (slots, [view(self.buffer, slot) for slot in slots])
        packed = list(leaves)
        for (k, t), slot, target in zip(found, *known):
            target.copy_(t.detach() if t.requires_grad else t)
            packed[k] = slot
        return packed, grown


def unpack(buffer: torch.Tensor, leaves: Sequence[Any], copy: bool) -> list:
    """``leaves`` with each Slot read from ``buffer``: a copy where the tensor must outlive the next message."""
    return [(view(buffer, v).clone() if copy else view(buffer, v)) if isinstance(v, Slot) else v for v in leaves]


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
    """One side of a worker's block: the caller makes it (``Mailbox()``), the worker opens
    ``Mailbox(block, WORKER)``."""

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

        self._futex.wait(self._theirs, target, between, yield_core=False)

    def stop(self) -> None:
        """(Caller) set the stop word and wake the worker: it leaves its wait for the next request."""
        self._stop.value = 1
        self._futex.wake(self._base + _COUNTER[CALLER], 1)


def _private_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # private copies of ``module``'s (shared) buffers: (shared, private) pairs to refresh them
    pairs = []
    for m in module.modules():
        for key, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[key] = b.clone()
                pairs.append((b, m._buffers[key]))
    return pairs


@dataclass
class _Buffers:
    """This worker's slot buffers: the caller's (read), its own (written), its parameter gradients'."""

    inbox: torch.Tensor
    outbox: Arena
    grads: list[torch.Tensor]  # per parameter that requires grad, its gradient slot (a view of one shared buffer)


def _detach(leaf: Any) -> Any:
    t = _tensor(leaf)
    return leaf if t is None else _with_tensor(leaf, t.detach())


@dataclass
class Graph:
    """One replica's graph of one forward: its outputs and what to differentiate (parameters, then inputs)."""

    outputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    num_inputs: int


@dataclass
class Replica:
    """A replica as ``run_forward`` runs it: the module, its submodules (walked once), its own parameter leaves."""

    module: nn.Module
    modules: list[nn.Module]
    params: list[torch.Tensor]


def replica_of(module: nn.Module) -> Replica:
    """``module`` as a replica: each parameter that requires grad swapped for a leaf of its own on the same memory."""
    _, aliases, _ = _alias_parameters([module])
    return Replica(module, list(module.modules()), aliases[0])


def run_forward(replica: Replica, leaves: list, spec: Spec, differentiable: list[int], grad: bool,
                training: list[bool]) -> tuple[list, Spec, Graph | None]:
    """Run one replica (a worker's, or the caller's replica 0) on its flattened arguments (tensors detached, owned by
    this call): its output's leaves, their spec, and its graph (None without grad)."""
    for m, flag in zip(replica.modules, training):
        if m.training is not flag:  # nn.Module.__setattr__ is slow: most steps change nothing
            m.training = flag
    inputs = []
    for k in differentiable:
        t = _tensor(leaves[k]).requires_grad_(grad)
        inputs.append(t)
        # a clone, so that the module may modify its argument in place as it may a non-leaf in the caller
        leaves[k] = _with_tensor(leaves[k], t.clone() if grad else t)
    args, kwargs = unflatten(spec, leaves)
    with torch.set_grad_enabled(grad):
        out = replica.module(*args, **kwargs)
    out_leaves, out_spec = flatten(out, "output")
    values = [v for _, v in out_leaves]
    if not grad:
        return values, out_spec, None
    tensors = [t for t in (_tensor(v) for v in values) if t is not None]
    return values, out_spec, Graph(tensors, replica.params + inputs, len(inputs))


def run_backward(graph: Graph, grads: list) -> list:
    """The gradients of ``graph.targets`` (None where unused) given its outputs' (None where the caller has none); the
    graph is kept until its owner drops it."""
    pairs = [(o, g) for o, g in zip(graph.outputs, grads) if g is not None and o.requires_grad]
    if not pairs or not graph.targets:
        return [None] * len(graph.targets)
    return list(torch.autograd.grad([o for o, _ in pairs], graph.targets, [g for _, g in pairs],
                                    retain_graph=True, allow_unused=True))


def _forward(replica: Replica, msg: Forward, graphs: dict, io: _Buffers) -> Outputs:
    # copies: the graph may save an input for backward, and the caller reuses its buffer for the next forward
    leaves = unpack(io.inbox, msg.leaves, copy=True)
    values, spec, graph = run_forward(replica, leaves, msg.spec, msg.differentiable, msg.grad, msg.training)
    if graph is not None:
        graphs[msg.step] = graph
    packed, grown = io.outbox.pack([_detach(v) for v in values])
    return Outputs(packed, spec, grown)


def _backward(msg: Backward, graphs: dict, io: _Buffers) -> Gradients:
    if msg.step not in graphs:
        raise RuntimeError("this worker holds no graph of that forward: the workers were restarted since (a "
                           "structure change, a dead worker or close()); run the forward again")
    graph = graphs[msg.step]  # kept until the caller releases it
    grads = run_backward(graph, unpack(io.inbox, msg.grads, copy=False))  # read before answering: no copy needed
    split = len(graph.targets) - graph.num_inputs
    with torch.no_grad():
        for g, slot in zip(grads[:split], io.grads):
            if g is not None and g.layout == torch.strided:
                slot.copy_(g)
    packed, grown = io.outbox.pack(grads[split:])
    return Gradients([g if g is None or g.layout != torch.strided else True for g in grads[:split]], packed, grown)


def _check_caller(pid: int) -> None:
    if not alive(pid):
        raise ProcessLookupError(pid)


def worker_main(index: int, module: nn.Module, block: torch.Tensor, threads: int, caller: int, grads: torch.Tensor,
                grad_slots: list[Slot]) -> None:
    """The worker's entry point: serve its mailbox until told to stop or the caller is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    replica = replica_of(module)
    refresh = _private_buffers(module) if index > 0 else []
    io = _Buffers(torch.empty(0, dtype=torch.uint8), Arena(), [view(grads, slot) for slot in grad_slots])
    graphs: dict = {}
    mailbox = Mailbox(block, WORKER)
    mailbox.send(Ready(index, os.getpid()))
    while True:
        try:
            msg = mailbox.receive(lambda: _check_caller(caller))
        except (Stopped, OSError):
            return
        try:
            if msg.arena is not None:
                io.inbox = msg.arena
            if isinstance(msg, Forward):
                for step in msg.release:
                    graphs.pop(step, None)
                with torch.no_grad():
                    for shared, private in refresh:
                        private.copy_(shared)
                reply: Any = _forward(replica, msg, graphs, io)
            else:
                reply = _backward(msg, graphs, io)
        except Exception as exc:
            reply = Failure(index, type(exc).__name__, str(exc), traceback.format_exc())
        del msg
        try:
            mailbox.send(reply)
        except Exception as exc:  # an output that cannot be pickled: the caller must still get an answer
            io.outbox = Arena()  # it may have grown unsent: the next answer sends a fresh one
            mailbox.send(Failure(index, type(exc).__name__, f"cannot send the replica's answer: {exc}",
                                 traceback.format_exc()))
        del reply
