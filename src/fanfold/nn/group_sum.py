"""SyncBatchNorm's collectives over ranks: one all-reduce SUM per forward and per backward, each through an inspected
transport (DDP's under fanfold's DDP on the same group, else the layer's own), and their part in
``DistributedDataParallel.join()`` (zeros replayed; ``check_channel`` refuses a shared channel). See docs/syncbn.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.stall import InspectedTransport
from ..distributed.join import BACKWARD, JoinState

__all__ = ["group_size", "same_group", "GroupSum", "check_channel", "expect_in_join"]


def group_size(group: Any) -> int:
    """Ranks in ``group`` (None: the default group); 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


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


def same_group(a: Any, b: Any) -> bool:
    """Whether process groups ``a`` and ``b`` are one (None: the default group)."""
    world = dist.group.WORLD
    return (a or world) is (b or world)


def check_channel(state: JoinState, group: Any, name: str) -> None:
    """Refuse a join context whose DDP collectives go over the same torch.distributed group as this layer's."""
    if state.transport.on_group(group):  # the shared-memory transport, or a user's, is a channel of its own
        raise RuntimeError(
            f"{name}: DistributedDataParallel.join() cannot shadow SyncBatchNorm when DDP's collectives and "
            "SyncBatchNorm's share one process group (transport='torch' on the same group): a rank that has joined "
            "could not reproduce how the two interleave in backward. Give SyncBatchNorm a group of its own "
            "(convert_sync_batchnorm(model, process_group=torch.distributed.new_group()), on every rank), or use "
            "the shared-memory transport (transport='shm') where every rank shares a host.")


def expect_in_join(state: JoinState, numel_forward: int, numel_backward: int, device: torch.device,
                   dtype: torch.dtype, transport: InspectedTransport) -> None:
    """What a rank that joins before training a single step inside the context replays: this layer's forward
    collective and its backward collective, as in a step where every layer runs once (forward in module order)."""
    state.expect(functools.partial(_zeros_all_reduce, numel_forward, dtype, device, transport),
                 functools.partial(_zeros_all_reduce, numel_backward, dtype, device, transport))

