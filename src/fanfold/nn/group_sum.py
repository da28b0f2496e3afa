"""Where SyncBatchNorm's parts meet: replicas (threads of one process) at a ``Rendezvous``, ranks in one all-reduce
SUM per forward and per backward through an inspected transport (``GroupSum``), with their part in
``DistributedDataParallel.join()``. See docs/syncbn.md.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..collectives.stall import InspectedTransport
from ..distributed.join import BACKWARD, JoinState
from .functions import wide_dtype

_EMPTY = object()


def _zeros_all_reduce(numel: int, dtype: torch.dtype, device: torch.device, transport: InspectedTransport) -> None:
    transport.all_reduce_now(torch.zeros(numel, dtype=dtype, device=device))


@dataclass
class GroupSum:
    """Sums one layer's packed vectors over the ranks: through ``shared`` (DDP's transport on the layer's group, if
    any) outside ``join`` (the open join context), else through ``own`` (a callable giving the layer's own
    transport, made at first use); ``name`` for errors."""

    own: Any
    join: JoinState | None
    name: str
    shared: InspectedTransport | None = None

    def __call__(self, vec: torch.Tensor, phase: int) -> torch.Tensor:
        join = self.join
        if join is not None and phase == BACKWARD and not join.begin_backward():
            # A backward DDP does not synchronise (no_sync()): no announcement, so a rank that has joined would
            # never hear of this collective.
            if join.alive < join.transport.world_size:
                raise RuntimeError(
                    f"{self.name}: a backward under no_sync() inside DistributedDataParallel.join() while rank(s) "
                    f"{sorted(set(range(join.transport.world_size)) - set(join.last_active))} have run out of "
                    "inputs: they cannot take part in SyncBatchNorm's backward. Synchronise every backward inside "
                    "join(), or accumulate gradients outside it.")
            join = None  # all ranks are here; nothing to record (a shadow replays synchronised backwards only)
        transport = self.shared if self.shared is not None and self.join is None else self.own()
        transport.all_reduce_now(vec)
        if join is not None:
            join.record(phase, functools.partial(_zeros_all_reduce, vec.numel(), vec.dtype, vec.device, transport))
        return vec


def check_channel(state: JoinState, group: Any, name: str) -> None:
    """Refuse a join context whose DDP collectives go over the same torch.distributed group as this layer's."""
    if state.transport.on_group(group):  # the shared-memory transport, or a user's, is a channel of its own
        raise RuntimeError(
            f"{name}: DistributedDataParallel.join() cannot shadow SyncBatchNorm when DDP's collectives and "
            "SyncBatchNorm's share one process group (transport='torch' on the same group): a rank that has joined "
            "could not reproduce how the two interleave in backward. Give SyncBatchNorm a group of its own "
            "(convert_sync_batchnorm(model, process_group=torch.distributed.new_group()), on every rank), or use "
            "the shared-memory transport (transport='shm') where every rank shares a host.")


def expect_in_join(state: JoinState, channels: int, device: torch.device, transport: InspectedTransport) -> None:
    """What a rank that joins before training a single step inside the context replays: this layer's forward
    collective (2C+1 numbers) and its backward collective (2C), as in a step where every layer runs once."""
    dtype = wide_dtype(device)
    state.expect(functools.partial(_zeros_all_reduce, 2 * channels + 1, dtype, device, transport),
                 functools.partial(_zeros_all_reduce, 2 * channels, dtype, device, transport))

class Rendezvous:
    """A barrier with one slot per replica, one meeting after another: the last to arrive combines the payloads in
    replica order (every replica sees the same bits); every wait is bounded, and a replica that never comes makes the
    others raise naming it, after which the rendezvous stays broken. ``name`` and ``timeout`` (seconds) for errors."""

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
