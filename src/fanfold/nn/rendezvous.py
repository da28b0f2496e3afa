"""Where the replicas of one SyncBatchNorm meet inside one DataParallel forward: a barrier with one slot per replica.

No torch.distributed: the replicas are threads of one process. The last replica to arrive combines the payloads in
replica order, so every replica sees the same bits; every wait is bounded, and a replica that never comes makes the
others raise naming it, after which the rendezvous stays broken so later meetings fail at once.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Rendezvous", "ReplicaLink"]

_EMPTY = object()


class Rendezvous:
    """``parties`` replicas meet here, one meeting after another; ``name`` and ``timeout`` (seconds) for errors."""

    def __init__(self, parties: int, name: str, timeout: float):
        self.parties, self.name, self.timeout = parties, name, timeout
        self._cond = threading.Condition()
        self._slots: list[Any] = [_EMPTY] * parties
        self._arrived = 0
        self._round = 0
        self._result: Any = None
        self._error: BaseException | None = None

    def meet(self, index: int, payload: Any, combine: Callable[[list[Any]], Any], what: str) -> Any:
        """Deposit ``payload`` as replica ``index``; once all have, ``combine(payloads)`` runs once (in the last
        replica's thread) and every replica returns its result. ``what`` names the meeting in errors."""
        with self._cond:
            if self._error is not None:
                raise self._failed(what)
            if self._slots[index] is not _EMPTY:
                raise RuntimeError(f"{self.name}: replica {index} reached the {what} twice before replicas "
                                   f"{self._missing()} reached it once")
            self._slots[index] = payload
            self._arrived += 1
            if self._arrived == self.parties:
                payloads = self._slots
                self._slots, self._arrived = [_EMPTY] * self.parties, 0
                try:
                    self._result = combine(payloads)
                except BaseException as exc:
                    self._error = exc
                    self._cond.notify_all()
                    raise
                self._round += 1
                self._cond.notify_all()
                return self._result
            # The result of this round stays until all have read it: the next round cannot complete without them.
            mine = self._round
            self._cond.wait_for(lambda: self._round != mine or self._error is not None, self.timeout)
            if self._round != mine:
                return self._result
            if self._error is not None:
                raise self._failed(what)
            self._error = RuntimeError(
                f"{self.name}: replica(s) {self._missing()} of {self.parties} did not reach the {what} within "
                f"{self.timeout:g} s (replica {index} waited). A replica that raised earlier, a backward that "
                "reached only some replicas, or replicas run one after another instead of concurrently "
                "(fanfold.DataParallel runs them concurrently); the timeout is $FANFOLD_STALL_TIMEOUT")
            self._cond.notify_all()
            raise self._error

    def _missing(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is _EMPTY]

    def _failed(self, what: str) -> RuntimeError:
        err = RuntimeError(f"{self.name}: the replicas cannot meet at the {what}: a meeting failed "
                           f"({type(self._error).__name__}: {self._error})")
        err.__cause__ = self._error
        return err


@dataclass(frozen=True)
class ReplicaLink:
    """What one replica of a SyncBatchNorm knows about its siblings for one forward (and its backward)."""

    rendezvous: Rendezvous
    index: int
    concurrent_backward: bool  # True: each replica runs its backward in its own thread (parallel_backward)
