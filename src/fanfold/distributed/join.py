"""Uneven inputs for ``DistributedDataParallel.join()``: the join-state exchange, the shadow loop of ranks that ran out
of data (issuing every announced collective with zeros), and ``DDPParticipant`` (``fanfold.SyncBatchNorm``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["JoinState", "DDPParticipant", "FORWARD", "BACKWARD"]

FORWARD, BACKWARD = 1, 2
_ALIVE, _FWD, _BWD, _BUFS = 0, 1, 2, 3  # slots of the announcement; rank r's activity is slot 4 + r


class JoinState:
    """One ``join()`` context of one rank."""

    def __init__(self, transport: Any, throw_on_early_termination: bool):
        self.transport, self.throw = transport, throw_on_early_termination
        self.last_active: list[int] = list(range(transport.world_size))
        self.alive = transport.world_size  # active ranks at the last exchange
        self.on_alive: Callable[[int], None] = lambda alive: None  # DDP's divisor, at each exchange with active ranks
        # DDP's: starts a synchronised backward (its announcement) if not yet done; False if it does not synchronise
        self.begin_backward: Callable[[], bool] = lambda: False
        self._replays: dict[int, list[Callable[[], None]]] = {FORWARD: [], BACKWARD: []}

    def _exchange(self, what: int, sync_buffers: bool, active: bool) -> torch.Tensor:
        t = self.transport
        flag = torch.zeros(4 + t.world_size, dtype=torch.float32)
        if active:
            flag[_ALIVE] = 1.0
            flag[_FWD if what == FORWARD else _BWD] = 1.0
            flag[_BUFS] = float(sync_buffers)
            flag[4 + t.rank] = 1.0
        t.all_reduce(flag).wait()
        alive = int(flag[_ALIVE])
        if alive:
            self.last_active = [r for r in range(t.world_size) if flag[4 + r] > 0]
            self.alive = alive
            self.on_alive(alive)
        return flag

    def announce(self, what: int, sync_buffers: bool = False) -> tuple[int, int]:
        """Before an active rank's forward or backward: (active ranks, the rank buffers come from: the highest active
        rank, as torch's DDP under join)."""
        flag = self._exchange(what, sync_buffers, active=True)
        self._replays[what] = []  # what participants issue from here on is this phase's new record
        alive = int(flag[_ALIVE])
        if self.throw and alive < self.transport.world_size:
            gone = sorted(set(range(self.transport.world_size)) - set(self.last_active))
            raise RuntimeError(
                "Detected at least one rank that exhausted inputs. Throwing across all ranks. "
                f"(DistributedDataParallel.join(throw_on_early_termination=True): rank(s) {gone} ran out of inputs "
                f"while rank {self.transport.rank} still has some)")
        return alive, max(self.last_active)

    def shadow(self, sync_buffers: Callable[[int], None], shadow_backward: Callable[[], None]) -> int:
        """Mirror the active ranks' collectives until every rank has joined; returns the authoritative rank, torch's
        DDP's: the highest of the ranks that joined last (those active at the last exchange)."""
        while True:
            flag = self._exchange(0, False, active=False)
            alive = int(flag[_ALIVE])
            if alive == 0:
                return max(self.last_active)  # every rank, if none was ever active: all joined last
            if self.throw:
                raise RuntimeError(
                    f"Rank {self.transport.rank} exhausted all inputs. (DistributedDataParallel.join("
                    f"throw_on_early_termination=True): rank {self.transport.rank} ran out of inputs while rank(s) "
                    f"{self.last_active} still have some)")
            if flag[_FWD] > 0:
                if flag[_BUFS] > 0:
                    sync_buffers(max(self.last_active))
                for replay in self._replays[FORWARD]:
                    replay()
            if flag[_BWD] > 0:
                # before the buckets: the active ranks launch their bucket all-reduces without waiting, in between
                # these (on a channel of their own), and wait for the buckets only at the end of backward
                for replay in self._replays[BACKWARD]:
                    replay()
                shadow_backward()

    def record(self, phase: int, replay: Callable[[], None]) -> None:
        """A participant issued a collective in this rank's ``phase``; ``replay`` issues it contributing nothing."""
        self._replays[phase].append(replay)

    def expect(self, forward: Callable[[], None], backward: Callable[[], None]) -> None:
        """A participant's replays for a rank that joins before recording a step (backwards in reverse module order)."""
        self._replays[FORWARD].append(forward)
        self._replays[BACKWARD].insert(0, backward)


@runtime_checkable
class DDPParticipant(Protocol):
    """A submodule whose forward or backward issues collectives of its own (implemented in ``fanfold.nn``)."""

    def use_transport(self, transport: Any, process_group: Any) -> None:
        """At ``DistributedDataParallel`` construction: DDP's transport and its process group (None: the default)."""

    def set_join_state(self, state: JoinState | None) -> None:
        """``DistributedDataParallel.join()`` on entry (the state; may raise to refuse) and on exit (None)."""
