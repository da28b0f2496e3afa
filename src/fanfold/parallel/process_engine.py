"""``DataParallel(..., engine="process")``: replica 0 in the caller, one worker process per further CPU replica
sharing the module's memory; the wire between them (shared-memory slots for a message's tensors, small dataclass
messages, a futex-woken mailbox where a step's repeated messages cross as a few bytes); ``Remote`` joins the workers'
outputs to the caller's graph.
"""
from __future__ import annotations

import ctypes
import io
import math
import multiprocessing as mp
import os
import pickle
import select
import signal
import struct
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (torch's reductions, which send tensors through shared memory)
from torch import nn
from torch.autograd import Function

from .._core.shm import SPIN_S, Futex, alive, shared_bytes
from .._core.tree import Spec, flatten, unflatten
from ..launcher.spawn import reap
from .parallel_backward import _alias_parameters, _tensor, _with_tensor
from .replicate import replicate

ALIGN = 64  # bytes: every slot starts on a cache line, so any dtype's view of the byte buffer is aligned


@dataclass(frozen=True)
class Slot:
    """Where one dense tensor lies in a byte buffer; ``stride`` keeps its memory format (channels_last, say)."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    # ``t``'s strides where its layout is dense in some order of the dims (channels_last, a transpose), else the
    # dense layout ``torch.empty_like`` gives it
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
    nbytes = math.prod(slot.shape) * slot.dtype.itemsize
    return buffer[slot.offset:slot.offset + nbytes].view(slot.dtype).as_strided(slot.shape, slot.stride)


class Arena:
    """One direction's slot buffer for one worker, sent again only when it grows; one layout kept per structure (the
    same ``Slot`` objects each step: what lets a message cross compact)."""

    _KEEP = 8  # layouts kept; more distinct structures than this are laid out again

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._layouts: dict[tuple, tuple[list[Slot], list[torch.Tensor]]] = {}

    def pack(self, leaves: Sequence[Any]) -> tuple[list, torch.Tensor | None]:
        """``leaves``, each plain tensor copied in and replaced by its Slot; the new buffer if it grew, else None."""
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


_KINDS = (Forward, Backward, Outputs, Gradients)  # a compact message's first byte: the index + 1
# a repeat carries the step's numbers (step, grad, release) and takes every other field from the last full message
_FIXED = {k: [f.name for f in fields(k) if f.name not in ("step", "grad", "release", "arena")] for k in _KINDS}
_SCALARS = (Slot, type(None), bool, int, float, str)  # leaves that are the same value when they are the same object


def _template(msg: Any) -> bool:
    # later messages may repeat ``msg``: its lists hold values compared by identity, its spec compares by value (no
    # instance kept as a template: a dataclass, a dict subclass)
    return all(all(type(v) in _SCALARS for v in x) if isinstance(x, list) else
               all(n.template is None or isinstance(n.template, type) for n in x.nodes)
               for x in (getattr(msg, name) for name in _FIXED[type(msg)]))


def _repeats(msg: Any, last: Any) -> bool:
    for name in _FIXED[type(msg)]:
        a, b = getattr(msg, name), getattr(last, name)
        if not (len(a) == len(b) and all(x is y for x, y in zip(a, b)) if isinstance(a, list) else a == b):
            return False
    return msg.arena is None


CALLER, WORKER = 0, 1
_COUNTER = (0, 64)  # byte offset of each side's counter: cache lines of their own
_STOP = 128
_LENGTH = (192, 200)  # int64: the length of each side's current message
_HEADER = 4096
_AREA = 1 << 16  # bytes per side's message area; bigger messages are spilled
_PICKLE = pickle.PROTO[0]  # the first byte of every pickle this side makes (protocol 2 and up)
# how long a side polls for the other's message before sleeping, where every replica has a core: a step's serial work
# between two messages (the loss, the optimizer step, the next batch's scatter) takes some hundred microseconds, and
# a futex wake-up costs about as much again on each side (issue 25); with fewer cores the short default of the
# shared-memory layer (SPIN_S) leaves the core to a replica that computes
_SPIN_S = 1e-3


@dataclass
class _Spill:
    data: torch.Tensor  # the pickled bytes of a message too big for its area


class Stopped(Exception):
    """The caller has set the stop word."""


class Mailbox:
    """One side of a worker's block: the caller makes it (``Mailbox()``), the worker opens
    ``Mailbox(block, WORKER)``; ``spin_s``: seconds a wait polls before it sleeps."""

    def __init__(self, block: torch.Tensor | None = None, side: int = CALLER, spin_s: float = SPIN_S) -> None:
        self._futex = Futex("DataParallel(engine='process')")
        self._spin_s = spin_s
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
        self._sent: dict[type, Any] = {}  # per kind, the last full message sent, if later ones may repeat it
        self._got: dict[type, Any] = {}  # per kind, the last full message received
        self.posted = 0  # messages this side has posted
        self.read = 0  # messages of the other side this side has read

    def send(self, message: Any) -> None:
        """Post ``message`` (the other side must have read the previous one: the protocol alternates)."""
        data = self._compact(message)
        if data is None:
            data = self._pickle(message)
            if len(data) > _AREA:
                data = self._pickle(_Spill(torch.frombuffer(bytearray(data), dtype=torch.uint8).share_memory_()))
            if type(message) in _KINDS:  # pickled: the receiver will have it
                self._sent[type(message)] = message if _template(message) else None
        ctypes.memmove(self._base + _HEADER + self.side * _AREA, data, len(data))
        self._lengths[self.side].value = len(data)
        self.posted += 1
        self._mine.value = self.posted & 0xFFFFFFFF
        self._futex.wake(ctypes.addressof(self._mine), 1)

    def _compact(self, msg: Any) -> bytes | None:
        # ``msg`` as its kind and its numbers when it repeats the last full message of its kind sent
        last = self._sent.get(type(msg))
        if last is None or not _repeats(msg, last):
            return None
        if type(msg) is Forward:
            numbers = [msg.step, msg.grad, *msg.release]
        else:
            numbers = [msg.step] if type(msg) is Backward else []
        return struct.pack(f"<B{len(numbers)}q", _KINDS.index(type(msg)) + 1, *numbers)

    def _expand(self, data: bytes) -> Any:
        # built directly: dataclasses.replace walks the fields each call, on both sides of every step
        kind = _KINDS[data[0] - 1]
        numbers = struct.unpack_from(f"<{(len(data) - 1) // 8}q", data, 1)
        t = self._got[kind]
        if kind is Forward:
            return Forward(numbers[0], t.leaves, t.spec, t.differentiable, bool(numbers[1]), t.training,
                           list(numbers[2:]))
        if kind is Backward:
            return Backward(numbers[0], t.grads)
        if kind is Outputs:
            return Outputs(t.leaves, t.spec)
        return Gradients(t.parameters, t.inputs)

    def _pickle(self, message: Any) -> bytes:
        self._buffer.seek(0)
        self._buffer.truncate()
        self._pickler.clear_memo()
        self._pickler.dump(message)
        return self._buffer.getvalue()

    def receive(self, check: Callable[[], None], deadline: float | None = None) -> Any:
        """The other side's next message; ``check()`` runs every 50 ms while waiting (it raises to give up). Raises
        ``TimeoutError`` after ``deadline`` (``time.monotonic()``) and, in the worker, ``Stopped``."""
        # polls without yielding the core (on a busy machine a yield gives away a whole time slice), then sleeps
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

        self._futex.wait(self._theirs, target, between, yield_core=False, spin_s=self._spin_s)
        self.read += 1
        n = self._lengths[1 - self.side].value
        data = ctypes.string_at(self._base + _HEADER + (1 - self.side) * _AREA, n)
        if data[0] != _PICKLE:
            return self._expand(data)
        message = pickle.loads(data)
        if isinstance(message, _Spill):
            message = pickle.loads(ctypes.string_at(message.data.data_ptr(), message.data.numel()))
        if type(message) in _KINDS:
            self._got[type(message)] = message
        return message

    def stop(self) -> None:
        """(Caller) set the stop word and wake the worker."""
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
    inbox: torch.Tensor  # the caller's slot buffer
    outbox: Arena
    grads: list[torch.Tensor]  # per parameter that requires grad, its gradient slot (a view of one shared buffer)


def _detach(leaf: Any) -> Any:
    t = _tensor(leaf)
    return leaf if t is None else _with_tensor(leaf, t.detach())


@dataclass
class Graph:
    outputs: list[torch.Tensor]
    targets: list[torch.Tensor]  # what to differentiate: parameters, then inputs
    num_inputs: int


@dataclass
class Replica:
    module: nn.Module
    modules: list[nn.Module]  # module.modules(), walked once
    params: list[torch.Tensor]  # its own leaves of the parameters that require grad


def replica_of(module: nn.Module) -> Replica:
    """``module`` as a replica: each parameter that requires grad swapped for a leaf of its own on the same memory."""
    _, aliases, _ = _alias_parameters([module])
    return Replica(module, list(module.modules()), aliases[0])


def run_forward(replica: Replica, leaves: list, spec: Spec, differentiable: list[int], grad: bool,
                training: list[bool]) -> tuple[list, Spec, Graph | None]:
    """Run one replica on its flattened arguments (tensors detached, owned by this call): its output's leaves, their
    spec, and its graph (None without grad)."""
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
    """The gradients of ``graph.targets`` (None where unused) given its outputs'; the graph is kept."""
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
                grad_slots: list[Slot], spin_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    replica = replica_of(module)
    refresh = _private_buffers(module) if index > 0 else []
    io = _Buffers(torch.empty(0, dtype=torch.uint8), Arena(), [view(grads, slot) for slot in grad_slots])
    graphs: dict = {}
    mailbox = Mailbox(block, WORKER, spin_s)
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


def start_context(module: nn.Module) -> tuple[Any, bool]:
    # the multiprocessing context for ``module``'s workers, and whether it forks
    in_main = any(type(m).__module__ == "__main__" for m in module.modules())
    if in_main or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("fork"), True
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.multiprocessing", "fanfold"])
    return ctx, False


def structure(module: nn.Module) -> tuple[list, list[bool]]:
    # what the workers' copy of ``module`` depends on (compared at every forward); every submodule's ``training``
    sig: list = []
    training = []
    for m in module.modules():
        sig.append(type(m))
        training.append(m.training)
        sig.extend((id(t), t.data_ptr(), t.shape, t.dtype, t.requires_grad)
                   for t in chain(m._parameters.values(), m._buffers.values()) if t is not None)
    return sig, training


def stop_workers(procs: list, mailboxes: list, caller_threads: int = 0, set_to: int = 0) -> None:
    # the caller gets ``caller_threads`` back if its count is still the engine's ``set_to``
    for m in mailboxes:
        m.stop()
    reap(procs)
    if caller_threads > 0 and torch.get_num_threads() == set_to != caller_threads:
        torch.set_num_threads(caller_threads)


@dataclass
class Step:
    engine: Any
    generation: int
    steps: list[int]  # each worker's step number
    slices: list[tuple[int, int]]  # each replica's outputs' range
    inputs: list[list[int]]  # each replica's inputs' positions among the chunks
    num_chunks: int
    graph: Graph | None


class _Token:
    # lives as long as the caller's graph node: when it goes, the workers may drop their graphs of that step

    def __init__(self, engine: Any, steps: list[int]) -> None:
        self.engine, self.steps = weakref.ref(engine), steps

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            for w, step in enumerate(self.steps[:len(engine.released)]):  # worker w ran step: it may drop its graph
                engine.released[w].append(step)


def _sum(local: list, replies: list[Gradients], views: list[list[torch.Tensor]]) -> list:
    """Per parameter, replica 0's gradient plus the workers' (from their slots, or pickled where sparse), in replica
    order: a new tensor (autograd may hold the one it handed out elsewhere), or None where no replica used it."""
    sums = []
    for k, g in enumerate(local):
        parts = [g] + [views[w][k] if r.parameters[k] is True else r.parameters[k] for w, r in enumerate(replies)]
        parts = [p for p in parts if p is not None]
        total = parts[0].clone() if len(parts) == 1 else torch.add(parts[0], parts[1]) if parts else None
        for p in parts[2:]:
            total = total + p
        sums.append(total)
    return sums


class Remote(Function):
    """``Remote.apply(step, outputs, *chunks, *params)``: every replica's outputs, in the caller's graph."""

    @staticmethod
    def forward(ctx, step: Step, outputs: list, *tensors: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.step = step
        ctx.token = _Token(step.engine, step.steps)
        ctx.save_for_backward(torch.empty(0))  # so that autograd refuses a second backward without retain_graph
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        ctx.saved_tensors  # noqa: B018  (raises autograd's own error on a second backward without retain_graph)
        if torch.is_grad_enabled():
            raise RuntimeError("DataParallel(engine='process'): double backward (create_graph=True) is not "
                               "supported by the process engine; use engine='thread'")
        step, engine = ctx.step, ctx.step.engine
        if step.steps and step.generation != engine.generation:
            raise RuntimeError("DataParallel(engine='process'): the workers were stopped since this forward (close(), "
                               "a dead worker or Ctrl-C) or restarted (a structure change); run the forward again")

        def post(w: int) -> Backward:
            lo, hi = step.slices[w + 1]
            packed, grown = engine.inboxes[w].pack(list(grads[lo:hi]))
            return Backward(step.steps[w], packed, grown)

        def local() -> list:
            lo, hi = step.slices[0]
            return run_backward(step.graph, list(grads[lo:hi]))

        mine, replies = engine.exchange(len(step.steps), post, local, "backward")
        split = len(mine) - len(step.inputs[0])
        chunk_grads: list = [None] * step.num_chunks
        for pos, g in zip(step.inputs[0], mine[split:]):
            chunk_grads[pos] = g
        for w, reply in enumerate(replies):
            for pos, g in zip(step.inputs[w + 1], unpack(engine.outboxes[w], reply.inputs, copy=True)):
                chunk_grads[pos] = g
        return (None, None, *chunk_grads, *_sum(mine[:split], replies, engine.grad_views))


START_TIMEOUT = 120.0  # a forkserver's first start imports torch: slow on a loaded machine
STEP_TIMEOUT = 600.0  # one forward or backward of one replica
# a replica's exception is raised in the caller as the same type where it is one of these, else as RuntimeError
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, IndexError, KeyError, NotImplementedError)}


class WorkerDied(RuntimeError):
    """A replica's worker process ended without answering (restarted on the next call)."""


def _replica_error(index: int, exc: Exception) -> Exception:
    kind = type(exc).__name__
    where = "run by the caller" if index == 0 else "cannot send it its arguments"
    return _ERRORS.get(kind, RuntimeError)(f"in replica {index} (engine='process', {where}): {kind}: {exc}")


class ProcessEngine:
    """The replicas of one DataParallel; ``apply`` is its ``parallel_apply``. ``close()`` stops the workers."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.generation = 0  # bumped at every start and stop: a graph of an older one cannot go backward
        self._procs: list = []  # the workers of replicas 1, 2, ...
        self._mailboxes: list[Mailbox] = []
        self._signature: list | None = None
        self._step = 0
        self.released: list[list[int]] = []  # per worker, the steps whose graph the caller has dropped
        self._finalizer: Any = None
        self._exits: Any = None  # select.poll() of the workers' sentinels: readable once one has exited
        self._local: Replica | None = None  # replica 0, run by the caller
        self.params: list[torch.Tensor] = []  # the module's parameters that require grad
        self.inboxes: list[Arena] = []  # per worker, the caller's slot buffer (inputs, output gradients)
        self.outboxes: list[torch.Tensor] = []  # per worker, its slot buffer (outputs, input gradients)
        self.grad_views: list[list[torch.Tensor]] = []  # per worker, per parameter: its gradient slot, as a tensor

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs stop_workers once
        self._procs, self._mailboxes, self._signature, self._finalizer, self._local = [], [], None, None, None
        self._exits = None
        self.generation += 1

    def _start(self, module: nn.Module) -> None:
        self.close()
        for t in [*module.parameters(), *module.buffers()]:
            t.share_memory_()
        ctx, forked = start_context(module)
        caller_threads = torch.get_num_threads()
        threads = max(1, caller_threads // self.num_replicas)
        self.params = [p for p in module.parameters() if p.requires_grad]
        local = replica_of(replicate(module, ["cpu"])[0])  # shares the module's memory; writes its buffers
        slots, size = layout(self.params)
        workers = self.num_replicas - 1
        grads = [shared_bytes(max(size, 1)) for _ in range(workers)]
        self.grad_views = [[view(buffer, slot) for slot in slots] for buffer in grads]
        self.inboxes = [Arena() for _ in range(workers)]
        self.outboxes = [torch.empty(0, dtype=torch.uint8) for _ in range(workers)]
        self.released = [[] for _ in range(workers)]
        spin_s = _SPIN_S if self.num_replicas <= len(os.sched_getaffinity(0)) else SPIN_S
        procs: list = []
        mailboxes: list[Mailbox] = []
        self._procs, self._mailboxes, self._exits = procs, mailboxes, select.poll()
        self._finalizer = weakref.finalize(self, stop_workers, procs, mailboxes, caller_threads, threads)
        try:
            for w in range(workers):
                mailbox = Mailbox(spin_s=spin_s)
                p = ctx.Process(target=worker_main, args=(w + 1, module, mailbox.block, 1 if forked else threads,
                                                          os.getpid(), grads[w], slots, spin_s),
                                name=f"fanfold-replica-{w + 1}", daemon=True)
                with warnings.catch_warnings():  # the caller's hooks stay in the caller: the workers need none
                    warnings.filterwarnings("ignore", "backward hook .* will not be serialized")
                    try:
                        p.start()
                    except Exception as exc:
                        raise RuntimeError(f"DataParallel(engine='process'): cannot send the module to the worker "
                                           f"of replica {w + 1} ({type(exc).__name__}: {exc}); its attributes must "
                                           "be picklable, or use engine='thread'") from exc
                procs.append(p)
                mailboxes.append(mailbox)
                self._exits.register(p.sentinel, select.POLLIN)
            torch.set_num_threads(threads)  # the replicas share the caller's cores
            ready = self._collect(list(range(workers)), START_TIMEOUT, "start")
            if not all(isinstance(r, Ready) for r in ready):
                raise RuntimeError(f"DataParallel(engine='process'): a worker failed to start: {ready}")
        except BaseException:
            self.close()
            raise
        self._local = local
        self._signature = structure(module)[0]
        self.generation += 1

    def _check_alive(self, what: str) -> None:
        # every forward: one poll() of the sentinels, not is_alive() per worker (a selector made and closed each)
        if self._exits is not None and not self._exits.poll(0):
            return
        for w, p in enumerate(self._procs):
            if not p.is_alive():
                code = p.exitcode
                self.close()
                hint = "" if what != "start" else (
                    " (its stderr says why; a script must start the engine under `if __name__ == '__main__':`, "
                    "as for any multiprocessing start method but fork)")
                raise WorkerDied(f"DataParallel(engine='process'): the worker process of replica {w + 1} died "
                                 f"{'since the last call' if what == 'call' else 'during ' + what} (exit code {code})"
                                 f"{hint}; its workers are restarted on the next call")

    def _collect(self, workers: list[int], timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        replies = []
        for w in workers:
            try:
                replies.append(self._mailboxes[w].receive(lambda: self._check_alive(what), deadline))
            except TimeoutError:
                self.close()
                raise RuntimeError(f"DataParallel(engine='process'): replica {w + 1} did not finish {what} within "
                                   f"{timeout:.0f} s; the workers were stopped") from None
        return replies

    def exchange(self, count: int, post: Callable[[int], Any], local: Callable[[], Any], what: str) -> tuple:
        """Post ``post(w)`` to workers 0..count-1, run ``local()`` (replica 0) meanwhile: (its result, the workers'
        answers). A replica's exception is raised here, naming it; Ctrl-C stops the workers."""
        posted, failed, mine = [], None, None
        try:
            for w in range(count):
                try:
                    self._mailboxes[w].send(post(w))
                except Exception as exc:  # an argument that cannot be pickled: the posted ones must still answer
                    self.inboxes[w] = Arena()  # it may have grown unsent: the next step sends a fresh one
                    failed = (w + 1, exc)
                    break
                posted.append(w)
            if failed is None:
                try:
                    mine = local()
                except Exception as exc:
                    failed = (0, exc)
            replies = self._collect(posted, STEP_TIMEOUT, what)
        except KeyboardInterrupt:
            self.close()
            raise
        for w, reply in enumerate(replies):  # first every new buffer, also where another replica failed
            if getattr(reply, "arena", None) is not None:
                self.outboxes[w] = reply.arena
        if failed is not None:
            raise _replica_error(*failed) from failed[1]
        for reply in replies:
            if isinstance(reply, Failure):
                message = (f"in replica {reply.index} (engine='process'): {reply.kind}: {reply.message}\n\n"
                           f"Traceback in the worker process:\n{reply.traceback}")
                raise _ERRORS.get(reply.kind, RuntimeError)(message)
        return mine, replies

    def apply(self, module: nn.Module, inputs: Sequence[tuple], kwargs: Sequence[dict]) -> list:
        """``parallel_apply`` for the processes: one output per chunk, joined to the caller's graph."""
        self._check_alive("call")
        signature, training = structure(module)
        if self._local is None or signature != self._signature:
            self._start(module)
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        chunks: list[torch.Tensor] = []
        positions: list[list[int]] = []
        flat_inputs = []
        for i in range(len(inputs)):
            leaves, spec = flatten((tuple(inputs[i]), dict(kwargs[i])))
            values = [v for _, v in leaves]
            wanted = [k for k, v in enumerate(values) if _tensor(v) is not None and _tensor(v).requires_grad]
            positions.append(list(range(len(chunks), len(chunks) + len(wanted))))
            chunks.extend(_tensor(values[k]) for k in wanted)
            sent = [_detach(v) for v in values]
            flat_inputs.append((sent, spec, wanted if grad else []))
        steps = list(range(self._step + 1, self._step + len(inputs)))
        self._step += len(steps)

        def post(w: int) -> Forward:
            sent, spec, wanted = flat_inputs[w + 1]
            packed, grown = self.inboxes[w].pack(sent)
            release, self.released[w] = self.released[w], []
            return Forward(steps[w], packed, spec, wanted, grad, training, release, grown)

        def local() -> tuple:
            sent, spec, wanted = flat_inputs[0]
            return run_forward(self._local, sent, spec, wanted, grad, training)

        (values, spec, graph), replies = self.exchange(len(steps), post, local, "forward")
        outputs: list[tuple[list, Any]] = [([_detach(v) for v in values], spec)]
        reply: Outputs
        for w, reply in enumerate(replies):
            outputs.append((unpack(self.outboxes[w], reply.leaves, copy=True), reply.spec))
        flat, slices = [], []
        for leaves, _ in outputs:
            lo = len(flat)
            flat.extend(t for t in (_tensor(v) for v in leaves) if t is not None)
            slices.append((lo, len(flat)))
        if grad and (chunks or self.params):
            step = Step(self, self.generation, steps, slices, positions, len(chunks), graph)
            joined = iter(Remote.apply(step, flat, *chunks, *self.params))
        else:
            joined = iter(flat)
        return [unflatten(spec, [v if _tensor(v) is None else _with_tensor(v, next(joined)) for v in leaves])
                for leaves, spec in outputs]
