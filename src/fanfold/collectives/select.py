"""Which transport a group's collectives take, the same answer on every rank (:func:`choose`): all ranks on one host,
shared memory; on several hosts, some with more than one rank, the hierarchical transport; otherwise
torch.distributed's group. Used by fanfold's DDP, ``fanfold doctor`` and the ``fanfold`` backend. docs/hierarchical.md.
"""
from __future__ import annotations

import json
import os
import platform
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._core.devices import accelerator_type
from .._core.job import require_initialized
from .hierarchical import HierarchicalTransport, host_layout
from .protocol import TransportOwner
from .shm.segment import host_key
from .shm.transport import SegmentSpaceError, ShmTransport
from .timeouts import group_store
from .transport import TorchTransport

__all__ = ["select_transport", "resolve_transport", "host_views", "choose", "ENV_VAR", "CHOICES"]

ENV_VAR = "FANFOLD_TRANSPORT"
CHOICES = ("torch", "shm", "hierarchical")


def host_views(store: dist.Store, rank: int, world_size: int, asked: str | None, local: bool,
               wait: float | None = None, who: str = "choosing a transport") -> list[list]:
    """Every rank's ``[asked, host_key(), local]`` through ``store`` (collective), ``local``: whether shared memory
    may serve this rank (x86-64, whose total store order the segment relies on; CPU tensors). ValueError where the
    ranks ask for different transports; RuntimeError naming the ranks that did not come within ``wait`` seconds
    (None: the store's timeout); ``who`` says what waited."""
    store.set(str(rank), json.dumps([asked, host_key(), local]))
    keys = [str(r) for r in range(world_size)]
    try:
        store.wait(keys) if wait is None else store.wait(keys, timedelta(seconds=wait))
    except RuntimeError as exc:  # the store's own message is "Wait timeout": say who and what
        late = [r for r in range(world_size) if not store.check([str(r)])]
        if late:  # none: every rank came just after the wait's end (or the store's error was not a timeout)
            within = "" if wait is None else f" within {wait:g} s"
            raise RuntimeError(f"{who}: rank {rank} of {world_size} waited for ranks {late}, which never "
                               f"arrived{within}") from exc
        store.wait(keys)  # the store answers at once; a store that fails raises its own error
    views = [json.loads(store.get(k)) for k in keys]
    if len({v[0] for v in views}) > 1:
        raise ValueError(f"ranks ask for different transports (by rank, ${ENV_VAR} or transport=): "
                         f"{ {r: v[0] for r, v in enumerate(views)} }")
    return views


def choose(views: list[list]) -> tuple[str, str | None]:
    """The transport for ``views`` (:func:`host_views`) when none is asked for, and why it is not shared memory."""
    if not all(v[2] for v in views):
        return "torch", "shared memory needs x86-64 and CPU tensors"
    layout = host_layout([v[1] for v in views])
    if len(layout.hosts) == 1:
        return "shm", None
    return ("hierarchical", None) if layout.worthwhile else ("torch", "every rank runs on a host of its own")


def select_transport(group: Any = None, transport: str | None = None, device: Any = None) -> str:
    """"torch", "shm" or "hierarchical" for ``group`` (collective). ``transport`` (or ``$FANFOLD_TRANSPORT`` when
    None) forces a choice. Unforced: :func:`choose`, shared memory where the group's backend is gloo and the tensors
    live on the CPU (``device``; when None: no accelerator here)."""
    source = "transport"
    if transport is None:
        transport, source = os.environ.get(ENV_VAR) or None, ENV_VAR
    if transport is not None and transport not in CHOICES:
        raise ValueError(f"{source} must be 'torch', 'shm' or 'hierarchical', got {transport!r}")
    require_initialized("choosing a transport")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    local = platform.machine().lower() in ("x86_64", "amd64") and "nccl" not in dist.get_backend(group) and (
        torch.device(device).type == "cpu" if device is not None else accelerator_type() is None)
    # bounded by the store's (the process group's) timeout
    views = host_views(group_store(group, "select", rank), rank, world_size, transport, local)
    return transport if transport is not None else choose(views)[0]


def resolve_transport(transport: Any = None, group: Any = None, timeout: float | None = None) -> Any:
    """The transport named by ``transport``: None -> the group's own where it has one (``TransportOwner``: the
    ``fanfold`` backend's group), else ``$FANFOLD_TRANSPORT``, else ``select_transport``'s choice (collective;
    "shm" chosen, not asked for, becomes TorchTransport, announced, where /dev/shm has no room for it); "torch",
    "shm", "hierarchical" -> that transport; an object implementing ``protocol.Transport`` -> used as is.
    ``timeout``: the stall timeout of the transports made here."""
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
    methods = ("all_reduce", "reduce_tensors", "reduce_scatter", "reduce_scatter_tensors", "all_gather", "broadcast",
               "barrier")
    missing = [m for m in methods if not callable(getattr(transport, m, None))]
    missing += [a for a in ("rank", "world_size") if not isinstance(getattr(transport, a, None), int)]
    if missing:
        raise TypeError(f"transport {transport!r} lacks {missing} of fanfold.collectives.Transport "
                        f"({', '.join(methods)}, rank, world_size)")
    return transport
