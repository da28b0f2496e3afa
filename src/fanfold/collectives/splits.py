"""The bookkeeping of the ``fanfold`` backend's list collectives (``backend.py``): unflattening a flat result into
torch's output tensors, and all_to_all_single's element counts from torch's split sizes.

Layer: collectives, under ``backend.py``; torch only.
"""
from __future__ import annotations

import torch

__all__ = ["unflatten", "all_to_all_counts"]


def unflatten(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (any shapes), in order."""
    offset = 0
    for t in outs:
        t.detach().copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def all_to_all_counts(output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int],
                       n: int) -> tuple[list[int], list[int]] | None:
    """all_to_all_single's element counts (sent to each rank, received from each rank) from torch's split sizes
    (rows of dim 0; empty: equal parts), or None where they do not describe the tensors (gloo says why)."""
    if input.dim() == 0 or output.dim() == 0:
        return None
    counts = []
    for t, splits in ((input, in_splits), (output, out_splits)):
        rows = t.shape[0]
        if not splits:
            if rows % n:
                return None
            splits = [rows // n] * n
        if len(splits) != n or sum(splits) != rows or min(splits) < 0:
            return None
        row = t.numel() // rows if rows else 0
        counts.append([k * row for k in splits])
    return counts[0], counts[1]
