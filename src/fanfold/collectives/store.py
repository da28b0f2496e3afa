"""Store namespaces for collective objects: each transport-like object of a process group gets its own key space in
the group's store, found by creation order (every rank creates its objects in the same order)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["group_store"]


def group_store(group: Any, kind: str, rank: int) -> dist.Store:
    """A store namespace private to this rank's next ``kind`` object on ``group``: every rank creates its objects in
    the same order, so the n-th of each rank meet under the same prefix, with no process-wide counter."""
    name = (group if group is not None else dist.group.WORLD).group_name
    store = dist.PrefixStore(f"fanfold/{kind}/{name}/", dist.distributed_c10d._get_default_store())
    instance = store.add(f"instances/{rank}", 1)
    return dist.PrefixStore(f"{instance}/", store)
