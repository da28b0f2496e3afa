"""Which transport a group's collectives take: :func:`select_transport` (the same answer on every rank, from the
host identity of every rank, :func:`host_key`) and :func:`resolve_transport` (the object). All ranks on one host:
shared memory; ranks on several hosts, some host with more than one: the hierarchical transport (shared memory
inside each host, gloo across); otherwise torch.distributed's group. The choice is made once, when the group's
transport is set up (docs/hierarchical.md).

Used by fanfold's DDP (``resolve_transport``) and ``fanfold doctor``; the ``fanfold`` backend applies the same rule
to its own group (``backend.py``).
"""
from __future__ import annotations

import json
import os
import platform
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .._core.devices import accelerator_type
from .._core.job import require_initialized
from .hierarchical import HierarchicalTransport, host_layout
from .protocol import TransportOwner
from .shm.segment import host_key
from .shm.transport import SegmentSpaceError, ShmTransport
from .store import group_store
from .transport import TorchTransport

__all__ = ["select_transport", "resolve_transport", "ENV_VAR", "CHOICES"]

ENV_VAR = "FANFOLD_TRANSPORT"
CHOICES = ("torch", "shm", "hierarchical")


def select_transport(group: Any = None, transport: str | None = None, device: Any = None) -> str:
    """"torch", "shm" or "hierarchical" for ``group``, the same answer on every rank (collective: every rank calls
    it).

    ``transport`` (or ``$FANFOLD_TRANSPORT`` when None) forces a choice; ranks that ask for different ones get a
    ValueError naming them. Unforced, when the group's backend is gloo, the tensors live on the CPU (``device``;
    when None: no CUDA here) and the machine is x86-64 (the segment's ordering relies on its total store order):
    "shm" when every rank has the same ``host_key`` (kernel and /dev/shm, compared through the store);
    "hierarchical" when the ranks are on several hosts and some host has more than one of them; "torch" otherwise
    (and always where the conditions fail).
    """
    source = "transport"
    if transport is None:
        transport, source = os.environ.get(ENV_VAR) or None, ENV_VAR
    if transport is not None and transport not in CHOICES:
        raise ValueError(f"{source} must be 'torch', 'shm' or 'hierarchical', got {transport!r}")
    require_initialized("choosing a transport")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    store = group_store(group, "select", rank)
    local = platform.machine().lower() in ("x86_64", "amd64") and "nccl" not in dist.get_backend(group) and (
        torch.device(device).type == "cpu" if device is not None else accelerator_type() is None)
    store.set(str(rank), json.dumps([transport, host_key(), local]))
    store.wait([str(r) for r in range(world_size)])  # bounded by the store's (the process group's) timeout
    views = [json.loads(store.get(str(r))) for r in range(world_size)]
    asked = {r: v[0] for r, v in enumerate(views)}
    if len(set(asked.values())) > 1:
        raise ValueError(f"ranks ask for different transports (by rank, {source}): {asked}")
    if transport is not None:
        return transport
    if not all(v[2] for v in views):
        return "torch"
    layout = host_layout([v[1] for v in views])
    return "shm" if len(layout.hosts) == 1 else "hierarchical" if layout.worthwhile else "torch"


def resolve_transport(transport: Any = None, group: Any = None, timeout: float | None = None) -> Any:
    """The transport named by ``transport``: None -> the group's own where it has one (``TransportOwner``: the
    ``fanfold`` backend's group), else ``$FANFOLD_TRANSPORT``, else ``select_transport``'s choice (collective;
    "shm" chosen, not asked for, becomes TorchTransport, announced, where /dev/shm has no room for it); "torch" ->
    TorchTransport; "shm" -> the shared-memory transport; "hierarchical" -> HierarchicalTransport; an object
    implementing ``protocol.Transport`` -> used as is. ``timeout``: the stall timeout of the transports made here
    (``timeouts.resolve_stall_timeout``)."""
    source = "transport"
    if transport is None:
        pg = group if group is not None or not dist.is_initialized() else dist.group.WORLD
        if isinstance(pg, TransportOwner):  # the fanfold backend's group: one collective layer for torch and DDP
            return pg.shared_transport() or TorchTransport(group, timeout=timeout)
        transport, source = select_transport(group), ENV_VAR
        if transport == "shm" and not os.environ.get(ENV_VAR):
            try:
                return ShmTransport(group, timeout)
            except SegmentSpaceError as exc:  # every rank raises it: all go through torch.distributed
                if dist.get_rank(group) == 0:
                    warnings.warn(f"fanfold: collectives go through torch.distributed, not shared memory: {exc}",
                                  stacklevel=3)
                return TorchTransport(group)
    if isinstance(transport, str):
        if transport == "torch":
            return TorchTransport(group, timeout=timeout)
        if transport == "shm":
            return ShmTransport(group, timeout)
        if transport == "hierarchical":
            return HierarchicalTransport(group, timeout)
        raise ValueError(f"{source} must be 'torch', 'shm', 'hierarchical' or a transport object, got {transport!r}")
    methods = ("all_reduce", "reduce_tensors", "reduce_scatter", "all_gather", "broadcast", "barrier", "allocate")
    missing = [m for m in methods if not callable(getattr(transport, m, None))]
    missing += [a for a in ("rank", "world_size") if not isinstance(getattr(transport, a, None), int)]
    if missing:
        raise TypeError(f"transport {transport!r} lacks {missing} of fanfold.collectives.Transport "
                        f"({', '.join(methods)}, rank, world_size)")
    return transport
