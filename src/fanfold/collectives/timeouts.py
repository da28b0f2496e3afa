"""What every collective object takes from its group: how long a rank waits for its peers (the stall timeout:
``stall_timeout`` argument, else ``$FANFOLD_STALL_TIMEOUT``, else 300 s; at most the group's timeout; replaced within
a :func:`stall_timeout` block) and the store namespace its objects meet in (:func:`group_store`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._core.stall_timeout import DEFAULT_STALL_TIMEOUT, ENV_VAR, resolve_stall_timeout

__all__ = ["resolve_stall_timeout", "stall_timeout", "bound", "group_timeout", "group_store", "group_namespace",
           "StoreGroup", "DEFAULT_STALL_TIMEOUT", "ENV_VAR"]

# The phase's timeout (stall_timeout's block), or None; why a ContextVar: docs/stalls.md
_PHASE: ContextVar[float | None] = ContextVar("fanfold_stall_timeout", default=None)


@dataclass(frozen=True)
class StoreGroup:
    """A process group that torch is still constructing (the ``fanfold`` backend's), known by its store, rank, size
    and timeout (seconds; None: unknown) only: neither ``dist.get_rank`` nor the default store applies yet."""
    store: dist.Store
    rank: int
    world_size: int
    timeout: float | None = None


def group_namespace(group: Any, kind: str) -> dist.Store:
    """The store namespace of ``kind`` objects on ``group`` (None: the default group; a ``StoreGroup``: its store)."""
    if isinstance(group, StoreGroup):  # the store is already the group's own
        return dist.PrefixStore(f"fanfold/{kind}/", group.store)
    name = (group if group is not None else dist.group.WORLD).group_name
    return dist.PrefixStore(f"fanfold/{kind}/{name}/", dist.distributed_c10d._get_default_store())


def group_store(group: Any, kind: str, rank: int) -> dist.Store:
    """A store namespace private to this rank's next ``kind`` object on ``group``: every rank creates its objects in
    the same order, so the n-th of each rank meet under the same prefix, with no process-wide counter."""
    store = group_namespace(group, kind)
    return dist.PrefixStore(f"{store.add(f'instances/{rank}', 1)}/", store)


def group_timeout(group: Any = None) -> float | None:
    """The timeout of process group ``group`` in seconds, where known: no stall timeout is longer."""
    if isinstance(group, StoreGroup):
        return group.timeout
    if not dist.is_initialized():
        return None
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # no CPU backend (NCCL's group), or one without options: the store's
        timeout = getattr(dist.distributed_c10d._get_default_store(), "timeout", None)
        return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def bound(base: float, group: float | None = None) -> float:
    """The bound of a collective started now: the open :func:`stall_timeout` block's, else ``base``; at most
    ``group``."""
    phase = _PHASE.get()
    seconds = base if phase is None else phase
    return seconds if group is None or seconds <= group else group


@contextmanager
def stall_timeout(seconds: float | timedelta) -> Iterator[float]:
    """Within the block, every fanfold collective started on this thread waits ``seconds`` for its peers (at most
    the process group's timeout) instead of ``$FANFOLD_STALL_TIMEOUT``: for a phase where one rank is busy alone
    for long, e.g. rank 0 evaluating or saving while the others wait in the next collective. Every rank opens it
    around the same collectives: it is the waiting ranks whose bound it lengthens. Yields the seconds."""
    value = resolve_stall_timeout(seconds)
    token = _PHASE.set(value)
    try:
        yield value
    finally:
        _PHASE.reset(token)
