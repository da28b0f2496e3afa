"""How stages hand each other activations and gradients: the ``Channel`` interface, ``ThreadChannel`` for stages on
threads of one process (an inbox per stage; a failing stage's ``abort`` makes the others' receives raise
:class:`StageAborted`) and ``ProcessChannel`` over torch.distributed point-to-point messages. Design: docs/pipeline.md.
"""
from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

__all__ = ["Channel", "ThreadChannel", "ProcessChannel", "Message", "StageAborted", "encode", "decode"]

Kind = Literal["activation", "grad", "abort"]


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
    microbatch); ``abort``: stage ``src`` failed, every other stage's pending and future receives raise."""

    def send(self, src: int, dst: int, kind: Kind, microbatch: int, value: Any) -> None: ...

    def recv(self, dst: int, src: int, kind: Kind, microbatch: int) -> Any: ...

    def abort(self, src: int) -> None: ...


class ThreadChannel:
    """Inboxes for ``stages`` stages running on threads of this process."""

    def __init__(self, stages: int) -> None:
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(stages)]
        # only stage dst's own thread touches _stash[dst]: no lock needed
        self._stash: list[dict[tuple[int, str, int], Any]] = [{} for _ in range(stages)]

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

    def abort(self, src: int) -> None:
        for dst, inbox in enumerate(self._inboxes):
            if dst != src:
                inbox.put(Message(src, "abort", -1))


# ---- between processes: a header (its length, structure, dtypes, shapes), then the tensors, one tag per (kind,
# micro-batch); sends are asynchronous and completed at the end of the pass (``finish``) ----------------------------
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_TENSOR, _TUPLE, _LIST = 0, 1, 2
_HEADER = 32  # int64 slots in the first message


def _items(kind: Kind, value: Any) -> tuple[int, list[torch.Tensor | None]]:
    if kind == "grad":
        return _LIST, list(value)
    if isinstance(value, torch.Tensor):
        return _TENSOR, [value]
    if isinstance(value, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in value):
        return (_TUPLE if isinstance(value, tuple) else _LIST), list(value)
    what = [type(x).__name__ for x in value] if isinstance(value, (tuple, list)) else type(value).__name__
    raise TypeError(f"between processes a stage may hand on a tensor or a flat tuple/list of tensors, got {what}")


def encode(kind: Kind, value: Any) -> tuple[list[int], list[torch.Tensor]]:
    """The header (its own length first, at least ``_HEADER`` slots) and the tensors to send for ``value``."""
    structure, items = _items(kind, value)
    header = [structure, len(items)]
    payload = []
    for t in items:
        if t is None:
            header.append(0)
            continue
        if t.dtype not in _CODE:
            raise TypeError(f"a stage's output of dtype {t.dtype} cannot be sent between processes")
        header += [1, _CODE[t.dtype], t.dim(), *t.shape]
        payload.append(t)
    header.insert(0, len(header) + 1)
    return header + [0] * (_HEADER - len(header)), payload


def decode(kind: Kind, header: list[int], receive: Callable[[torch.Size, torch.dtype], torch.Tensor]) -> Any:
    """The value of ``header`` (all of it: ``header[0]`` slots), its tensors filled in by ``receive(shape, dtype)``
    in the order they were sent."""
    structure, count, pos = header[1], header[2], 3
    items: list[torch.Tensor | None] = []
    for _ in range(count):
        present = header[pos]
        pos += 1
        if not present:
            items.append(None)
            continue
        dtype, ndim = _DTYPES[header[pos]], header[pos + 1]
        items.append(receive(torch.Size(header[pos + 2:pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    if kind == "grad":
        return items
    return items[0] if structure == _TENSOR else tuple(items) if structure == _TUPLE else items


class ProcessChannel:
    """Stages of one pipeline in the processes ``ranks`` (global rank of stage s at index s)."""

    def __init__(self, ranks: list[int], wire: torch.device) -> None:
        self.ranks = ranks
        self.wire = wire  # where tensors travel: host memory for gloo, the device for nccl
        self._pending: list[tuple[Any, torch.Tensor]] = []

    @staticmethod
    def _tag(kind: Kind, microbatch: int) -> int:
        return 2 * microbatch + (0 if kind == "activation" else 1)

    def send(self, src: int, dst: int, kind: Kind, microbatch: int, value: Any) -> None:
        header, payload = encode(kind, value)
        heads = [torch.tensor(header[:_HEADER], dtype=torch.int64, device=self.wire)]
        if len(header) > _HEADER:
            heads.append(torch.tensor(header[_HEADER:], dtype=torch.int64, device=self.wire))
        tag, peer = self._tag(kind, microbatch), self.ranks[dst]
        for t in (*heads, *(p.detach().to(self.wire).contiguous() for p in payload)):
            # each tensor stays referenced until its send completes
            self._pending.append((dist.isend(t, peer, tag=tag), t))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv(self, dst: int, src: int, kind: Kind, microbatch: int) -> Any:
        tag, peer = self._tag(kind, microbatch), self.ranks[src]

        def receive(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(shape, dtype=dtype, device=self.wire)
            dist.recv(t, peer, tag=tag)
            return t

        header = receive(torch.Size([_HEADER]), torch.int64).tolist()
        if header[0] > _HEADER:
            header += receive(torch.Size([header[0] - _HEADER]), torch.int64).tolist()
        return decode(kind, header, receive)

    def abort(self, src: int) -> None:
        # another process cannot be woken from here: its receive ends at the group's timeout, or the launcher
        # (fanfold run / fanfold.launch) stops every rank as soon as this one exits with the error
        pass

    def finish(self) -> None:
        """Wait until every send of this pass has completed."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
