"""How stages hand each other activations and gradients: the ``Channel`` interface and ``ThreadChannel``, its version
for stages on threads of one process (an inbox per stage, a stash for messages that arrive early). A failing stage
calls ``abort``, and every other stage's next receive raises :class:`StageAborted` instead of hanging.
``p2p.py`` is the same interface between processes.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = ["Channel", "ThreadChannel", "Message", "StageAborted"]

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
    def send(self, src: int, dst: int, kind: Kind, microbatch: int, value: Any) -> None:
        """Hand ``value`` to stage ``dst`` without waiting for it to be received."""

    def recv(self, dst: int, src: int, kind: Kind, microbatch: int) -> Any:
        """Wait for, and return, what ``src`` sent to ``dst`` as (kind, microbatch)."""

    def abort(self, src: int) -> None:
        """Stage ``src`` failed: make every other stage's pending and future receives raise."""


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
