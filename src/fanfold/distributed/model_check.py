"""The collectives of DDP's construction: every rank holds the same model; parameters and buffers from one rank.

Used by ``ddp.py`` (and the join and buffer syncs there); every collective goes through the transport
(``collectives``). The model check exchanges a fixed-size digest first and the details only on a mismatch, so a
wrong model fails in seconds, naming the first differing entry and the ranks, instead of hanging a broadcast.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from ..collectives.transport import all_gather_bytes, all_gather_rows

__all__ = ["check_same_model", "broadcast_tensors", "BROADCAST_BYTES"]

BROADCAST_BYTES = 64 * 1024 * 1024


def check_same_model(t: Any, module: nn.Module, ignored: frozenset = frozenset()) -> None:
    """Fail on every rank, naming the first differing parameter and the ranks, when the models differ (the
    ``ignored`` names aside: DDP leaves them alone, they may differ)."""
    entries = [f"parameter {n!r} shape {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
               for n, p in module.named_parameters() if n not in ignored]
    entries += [f"buffer {n!r} shape {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers() if n not in ignored]
    digest = hashlib.sha256("\n".join(entries).encode()).digest()[:16]
    rows = all_gather_rows(t, torch.tensor(list(digest), dtype=torch.float32))
    differ = [r for r in range(t.world_size) if not torch.equal(rows[r], rows[0])]
    if not differ:
        return
    lists = [json.loads(b) for b in all_gather_bytes(t, json.dumps(entries).encode())]
    r = differ[0]
    k = next((k for k, (a, b) in enumerate(zip(lists[0], lists[r])) if a != b), min(len(lists[0]), len(lists[r])))
    mine = lists[0][k] if k < len(lists[0]) else "nothing (its model ends there)"
    theirs = lists[r][k] if k < len(lists[r]) else "nothing (its model ends there)"
    raise RuntimeError(
        f"DistributedDataParallel (rank {t.rank}): the model differs between ranks {[0] + differ}: at entry {k} "
        f"rank 0 has {mine} but rank {r} has {theirs}. Every rank must build the same model (same code, "
        "arguments and checkpoint) before wrapping it."
    )


def broadcast_tensors(t: Any, tensors: list[torch.Tensor], src: int) -> None:
    """Broadcast ``tensors`` in place from ``src``: their bytes laid end to end, one flat uint8 tensor per device and
    at most 64 MiB (a large model is not copied whole), so that tensors of several dtypes (a BatchNorm's float
    statistics and int64 counter) cost one collective, not one per dtype: DDP does this before every forward."""
    groups: dict[torch.device, list[list[torch.Tensor]]] = {}
    # widest elements first: every tensor's bytes then start at a multiple of its element size (view(dtype) needs it)
    for tensor in sorted(tensors, key=lambda x: -x.element_size()):
        chunks = groups.setdefault(tensor.device, [[]])
        if chunks[-1] and sum(x.numel() * x.element_size() for x in chunks[-1]) >= BROADCAST_BYTES:
            chunks.append([])
        chunks[-1].append(tensor)
    with torch.no_grad():
        for chunk in (c for chunks in groups.values() for c in chunks):
            flat = torch.cat([x.reshape(-1).view(torch.uint8) for x in chunk])
            t.broadcast(flat, src)
            offset = 0
            for x in chunk:
                n = x.numel() * x.element_size()
                x.copy_(flat[offset: offset + n].view(x.dtype).view_as(x))
                offset += n
