"""Where the shared-memory transport may be used: :func:`select_transport` (the same answer on every rank) and the
host identity it compares (:func:`host_key`); :func:`group_store` gives each transport-like object its own key
space in the process group's store.

Layer: beside ``shm.py`` (the transport), used by it and by ``transport.resolve_transport``.
"""
from __future__ import annotations

import json
import os
import platform
from typing import Any

import torch
import torch.distributed as dist

from .shm_segment import SHM_DIR
from .transport import ENV_VAR

__all__ = ["select_transport", "host_key", "group_store"]


def group_store(group: Any, kind: str, rank: int) -> dist.Store:
    """A store namespace private to this rank's next ``kind`` object on ``group``: every rank creates its objects in
    the same order, so the n-th of each rank meet under the same prefix, with no process-wide counter."""
    name = (group if group is not None else dist.group.WORLD).group_name
    store = dist.PrefixStore(f"fanfold/{kind}/{name}/", dist.distributed_c10d._get_default_store())
    instance = store.add(f"instances/{rank}", 1)
    return dist.PrefixStore(f"{instance}/", store)


def host_key() -> str:
    """Equal for two processes exactly when they run on one kernel and see the same /dev/shm mount."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return f"no-shm-{os.getpid()}-{id(object())}"  # never equal to another process's key
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def select_transport(group: Any = None, transport: str | None = None, device: Any = None) -> str:
    """"torch" or "shm" for ``group``, the same answer on every rank (collective: every rank calls it).

    ``transport`` (or ``$FANFOLD_TRANSPORT`` when None) forces a choice; ranks that ask for different ones get a
    ValueError naming them. Unforced: "shm" when every rank sees the same kernel and /dev/shm (compared through
    the store), the group's backend is gloo, the tensors live on the CPU (``device``; when None: no CUDA here) and
    the machine is x86-64 (the segment's ordering relies on its total store order); "torch" otherwise.
    """
    source = "transport"
    if transport is None:
        transport, source = os.environ.get(ENV_VAR) or None, ENV_VAR
    if transport not in (None, "torch", "shm"):
        raise ValueError(f"{source} must be 'torch' or 'shm', got {transport!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("choosing a transport needs an initialised process group: call "
                           "fanfold.distributed.init_process_group() first (under `fanfold run` or fanfold.launch)")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    store = group_store(group, "select", rank)
    local = platform.machine().lower() in ("x86_64", "amd64") and "nccl" not in dist.get_backend(group) and (
        torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available())
    store.set(str(rank), json.dumps([transport, host_key(), local]))
    store.wait([str(r) for r in range(world_size)])  # bounded by the store's (the process group's) timeout
    views = [json.loads(store.get(str(r))) for r in range(world_size)]
    asked = {r: v[0] for r, v in enumerate(views)}
    if len(set(asked.values())) > 1:
        raise ValueError(f"ranks ask for different transports (by rank, {source}): {asked}")
    if transport is not None:
        return transport
    same_host = len({v[1] for v in views}) == 1
    return "shm" if same_host and all(v[2] for v in views) else "torch"
