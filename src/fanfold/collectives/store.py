"""Store namespaces for collective objects: each transport-like object of a process group gets its own key space in
the group's store, found by creation order (every rank creates its objects in the same order)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["group_store", "StoreGroup"]


@dataclass(frozen=True)
class StoreGroup:
    """A group known by its store, rank and size only: a process group that torch is still constructing (the
    ``fanfold`` backend's), not yet registered, so neither ``dist.get_rank`` nor the default store applies.
    ``timeout``: the group's, in seconds (None: unknown)."""
    store: dist.Store
    rank: int
    world_size: int
    timeout: float | None = None


def group_store(group: Any, kind: str, rank: int) -> dist.Store:
    """A store namespace private to this rank's next ``kind`` object on ``group``: every rank creates its objects in
    the same order, so the n-th of each rank meet under the same prefix, with no process-wide counter."""
    if isinstance(group, StoreGroup):  # the store is already the group's own
        store = dist.PrefixStore(f"fanfold/{kind}/", group.store)
    else:
        name = (group if group is not None else dist.group.WORLD).group_name
        store = dist.PrefixStore(f"fanfold/{kind}/{name}/", dist.distributed_c10d._get_default_store())
    instance = store.add(f"instances/{rank}", 1)
    return dist.PrefixStore(f"{instance}/", store)
