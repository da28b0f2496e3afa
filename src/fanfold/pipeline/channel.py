"""How stages hand each other activations and gradients: the ``Channel`` interface, ``ThreadChannel`` between
threads of one process and ``ProcessChannel`` over torch.distributed point-to-point messages."""
from __future__ import annotations

import pickle
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from .._core.tree import flatten, unflatten

__all__ = ["Channel", "ThreadChannel", "ProcessChannel", "Message", "StageAborted", "encode", "decode"]

Kind = Literal["activation", "grad", "skip", "skipgrad", "abort"]
_TAG = {"activation": 0, "grad": 1, "skip": 2, "skipgrad": 3}  # between processes: tag = 4 * microbatch + this


class StageAborted(RuntimeError):
    """This stage stopped because another stage failed (that stage's error is the one to read)."""


@dataclass
class Message:
    """What crosses from stage ``src`` to another stage: ``value`` of ``kind`` for ``microbatch``."""

    src: int
    kind: Kind
    microbatch: int
    value: Any = None


class Channel(Protocol):
    """``send`` does not wait for the receive; ``recv`` waits for what ``src`` sent to ``dst`` as (kind,
    microbatch); ``abort``: stage ``src`` failed, every other stage's pending and future receives raise, and so does
    its ``check`` (called before each step: no later micro-batch is scheduled)."""

    def send(self, src: int, dst: int, kind: Kind, microbatch: int, value: Any) -> None: ...

    def recv(self, dst: int, src: int, kind: Kind, microbatch: int) -> Any: ...

    def abort(self, src: int) -> None: ...

    def check(self, dst: int) -> None: ...


class ThreadChannel:
    """Inboxes for ``stages`` stages running on threads of this process."""

    def __init__(self, stages: int) -> None:
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(stages)]
        # only stage dst's own thread touches _stash[dst]: no lock needed
        self._stash: list[dict[tuple[int, str, int], Any]] = [{} for _ in range(stages)]
        self._failed: int | None = None  # the stage that failed first; set once, read by every worker

    def send(self, src: int, dst: int, kind: Kind, microbatch: int, value: Any) -> None:
        self._inboxes[dst].put(Message(src, kind, microbatch, value))

    def recv(self, dst: int, src: int, kind: Kind, microbatch: int) -> Any:
        key = (src, kind, microbatch)
        stash = self._stash[dst]
        while key not in stash:
            msg = self._inboxes[dst].get()
            if msg.kind == "abort":
                raise StageAborted(f"pipeline stage {dst} stopped because stage {msg.src} failed")
            stash[(msg.src, msg.kind, msg.microbatch)] = msg.value
        return stash.pop(key)

    def check(self, dst: int) -> None:
        failed = self._failed
        if failed is not None and failed != dst:
            raise StageAborted(f"pipeline stage {dst} stopped because stage {failed} failed")

    def abort(self, src: int) -> None:
        if self._failed is None:
            self._failed = src
        for dst, inbox in enumerate(self._inboxes):
            if dst != src:
                inbox.put(Message(src, "abort", -1))


# ---- between processes: the header's length, the header (the structure, each tensor's dtype and shape: the receiver
# does not know them, the last micro-batch is smaller), then the tensors, one tag per (kind, micro-batch); sends are
# asynchronous and completed at the end of the pass (``finish``) ----------------------------------------------------
@dataclass(frozen=True)
class _Slot:  # a tensor's place in a message's structure: what the receiver allocates for it
    dtype: torch.dtype
    shape: tuple[int, ...]


def encode(value: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header of ``value`` (its structure, a :class:`_Slot` per tensor, the other leaves as they are), pickled,
    and the tensors to send after it."""
    leaves, spec = flatten(value)
    slots = [_Slot(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else x for _, x in leaves]
    return pickle.dumps((spec, slots)), [x for _, x in leaves if isinstance(x, torch.Tensor)]


def decode(header: bytes, receive: Callable[[torch.Size, torch.dtype], torch.Tensor]) -> Any:
    """The value of ``header``, its tensors filled in by ``receive(shape, dtype)`` in the order they were sent."""
    spec, slots = pickle.loads(header)
    return unflatten(spec, [receive(torch.Size(x.shape), x.dtype) if isinstance(x, _Slot) else x for x in slots])


class ProcessChannel:
    """Stages of one pipeline in the processes ``ranks`` (global rank of stage s at index s)."""

    def __init__(self, ranks: list[int], wire: torch.device) -> None:
        self.ranks = ranks
        self.wire = wire  # where tensors travel: host memory for gloo, the device for nccl
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, src: int, dst: int, kind: Kind, microbatch: int, value: Any) -> None:
        header, payload = encode(value)
        heads = (torch.tensor([len(header)], dtype=torch.int64), torch.frombuffer(bytearray(header), dtype=torch.uint8))
        tag, peer = 4 * microbatch + _TAG[kind], self.ranks[dst]
        for t in (*heads, *payload):
            t = t.detach().to(self.wire).contiguous()
            # each tensor stays referenced until its send completes
            self._pending.append((dist.isend(t, peer, tag=tag), t))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv(self, dst: int, src: int, kind: Kind, microbatch: int) -> Any:
        tag, peer = 4 * microbatch + _TAG[kind], self.ranks[src]

        def receive(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(shape, dtype=dtype, device=self.wire)
            dist.recv(t, peer, tag=tag)
            return t

        size = int(receive(torch.Size([1]), torch.int64))
        # bytes through tolist(), not Tensor.numpy(): numpy is not a dependency
        return decode(bytes(receive(torch.Size([size]), torch.uint8).tolist()), receive)

    def abort(self, src: int) -> None:
        # another process cannot be woken from here: its receive ends at the group's timeout, or the launcher
        # (fanfold run / fanfold.launch) stops every rank as soon as this one exits with the error
        pass

    def check(self, dst: int) -> None:
        pass

    def finish(self) -> None:  # every send of this pass completed
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
