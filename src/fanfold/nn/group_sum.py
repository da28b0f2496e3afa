"""SyncBatchNorm's collectives over ranks: one all-reduce SUM on its torch.distributed process group, and their part
in ``DistributedDataParallel.join()``.

Layer: ``fanfold.nn``, over ``fanfold.distributed`` (the join state); used by ``syncbn.py``. Any backend that sums
a float64 tensor works (gloo, NCCL, ...): the collective is torch.distributed's own, on the layer's
``process_group`` -- or, under fanfold DDP on that same group, DDP's transport (``use_transport``): the shared-memory
one when the ranks share a host, at a fraction of gloo's latency: the transport under DDP's stall inspector, its
waits bounded by the transport itself, on the caller's thread where it can (``caller_thread_options``). All ranks
issue these in the same order as DDP's own collectives (autograd runs the same graph on each), so sharing DDP's
channel is safe -- except under ``join()``, below.

Under ``join()`` (uneven inputs) a rank that ran out of data no longer runs forward or backward, yet the ranks still
training issue these collectives. So while a join context is open, every collective a layer issues is recorded in
the join state (``JoinState.record``) with a replay that issues the same collective with zeros; once this rank has
joined, each forward and each synchronised backward that the others announce makes it replay what it recorded in
its own last forward or backward, in the same order -- nothing to contribute, nobody left waiting. Two orderings
make that safe: a layer's backward first makes sure DDP's announcement of the backward went out
(``JoinState.begin_backward``), since a BatchNorm near the output can run its backward before any parameter's
gradient is ready (which is what otherwise triggers it); and these collectives must not share a channel with DDP's
own, whose shadow issues its bucket all-reduces without knowing how they interleave with ours: inside ``join()``
they go through torch.distributed even where DDP's transport would serve, and a DDP transport on torch.distributed
with the same group is refused (``check_channel``).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import TorchTransport
from ..distributed.join import BACKWARD, JoinState
from ..distributed.stall import uninspected

__all__ = ["group_size", "same_group", "GroupSum", "caller_thread_options", "check_channel", "expect_in_join"]


def group_size(group: Any) -> int:
    """Ranks in ``group`` (None: the default group); 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _zeros_all_reduce(numel: int, dtype: torch.dtype, device: torch.device, group: Any) -> None:
    dist.all_reduce(torch.zeros(numel, dtype=dtype, device=device), group=group)


@dataclass
class GroupSum:
    """Sums one layer's packed vectors over ``group``; ``join``: the open join context, if any; ``name`` for errors."""

    group: Any
    join: JoinState | None
    name: str
    transport: Any = None  # DDP's, on the same group; not used inside join()
    options: dict = field(default_factory=dict)  # the transport's all_reduce keywords (caller_thread_options)

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
        if self.transport is not None and self.join is None:
            self.transport.all_reduce(vec, **self.options).wait()
        else:
            dist.all_reduce(vec, group=self.group)
        if join is not None:
            join.record(phase, functools.partial(_zeros_all_reduce, vec.numel(), vec.dtype, vec.device, self.group))
        return vec


def caller_thread_options(transport: Any) -> dict:
    """The keywords of ``transport.all_reduce`` that run a small collective on the calling thread when nothing else
    is in flight: the shared-memory transport's ``inline=True``, where it has it. SyncBatchNorm waits for each of
    its collectives at once, so a hand-off to the transport's thread and back would be all latency."""
    try:
        takes = "inline" in inspect.signature(transport.all_reduce).parameters
    except (AttributeError, TypeError, ValueError):  # no signature to read: no options
        takes = False
    return {"inline": True} if takes else {}


def same_group(a: Any, b: Any) -> bool:
    """Whether process groups ``a`` and ``b`` are one (None: the default group)."""
    world = dist.group.WORLD
    return (a or world) is (b or world)


def check_channel(state: JoinState, group: Any, name: str) -> None:
    """Refuse a join context whose DDP collectives go over the same torch.distributed group as this layer's."""
    inner = uninspected(state.transport)
    if not isinstance(inner, TorchTransport):
        return  # the shared-memory transport, or a transport of the user's: a channel of its own
    if same_group(inner.group, group):
        raise RuntimeError(
            f"{name}: DistributedDataParallel.join() cannot shadow SyncBatchNorm when DDP's collectives and "
            "SyncBatchNorm's share one process group (transport='torch' on the same group): a rank that has joined "
            "could not reproduce how the two interleave in backward. Give SyncBatchNorm a group of its own "
            "(convert_sync_batchnorm(model, process_group=torch.distributed.new_group()), on every rank), or use "
            "the shared-memory transport (transport='shm') where every rank shares a host.")


def expect_in_join(state: JoinState, numel_forward: int, numel_backward: int, device: torch.device,
                   dtype: torch.dtype, group: Any) -> None:
    """What a rank that joins before training a single step inside the context replays: this layer's forward
    collective and its backward collective, as in a step where every layer runs once (forward in module order)."""
    state.expect(functools.partial(_zeros_all_reduce, numel_forward, dtype, device, group),
                 functools.partial(_zeros_all_reduce, numel_backward, dtype, device, group))

