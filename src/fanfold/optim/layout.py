"""Where each rank's shard lies: contiguous equal slices of a flat view of all parameters.

The parameters, in optimizer order, are laid end to end, one flat space per (dtype, device) so that a space can be
all-gathered as one tensor. A space of ``T`` elements is cut into ``N`` slices of ``ceil(T / N)`` elements (the last
ones shorter or empty); rank ``r`` owns slice ``r``. A slice may start or end inside a parameter: the part of one
parameter inside one slice is a :class:`Piece`. Pure arithmetic, no collective; part of ``fanfold.optim``.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

__all__ = ["Piece", "Space", "plan_spaces", "pieces_of", "spans"]


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of parameter ``index`` (flattened), at ``offset`` in its rank's slice of ``space``."""

    index: int
    group: int
    space: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Space:
    """Parameters of one dtype and device, laid end to end: ``indices[i]`` starts at ``starts[i]``."""

    dtype: torch.dtype
    device: torch.device
    indices: tuple[int, ...]
    starts: tuple[int, ...]
    total: int
    world: int

    @property
    def shard(self) -> int:
        """Elements per slice (the padded size every rank sends in the all-gather)."""
        return -(-self.total // self.world)


def plan_spaces(params: list[torch.Tensor], world: int) -> list[Space]:
    """One :class:`Space` per (dtype, device), in order of first appearance; parameters keep their order."""
    keys: list[tuple[torch.dtype, torch.device]] = []
    members: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        key = (p.dtype, p.device)
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(i)
    spaces = []
    for key in keys:
        idx = members[key]
        starts, at = [], 0
        for i in idx:
            starts.append(at)
            at += params[i].numel()
        spaces.append(Space(key[0], key[1], tuple(idx), tuple(starts), at, world))
    return spaces


def pieces_of(spaces: list[Space], params: list[torch.Tensor], groups: list[int], rank: int) -> list[Piece]:
    """The pieces of rank ``rank``'s slices, in parameter order within each space; ``groups[i]`` is parameter i's
    group."""
    out = []
    for s, space in enumerate(spaces):
        lo = min(rank * space.shard, space.total)
        hi = min(lo + space.shard, space.total)
        for i, start in zip(space.indices, space.starts):
            a, b = max(lo, start), min(hi, start + params[i].numel())
            if a < b:
                out.append(Piece(i, groups[i], s, a - start, b - start, a - lo))
    return out


def spans(space: Space, numels: list[int], lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """The parameters under flat positions ``lo:hi`` of ``space``: ``(index, a, b, at)`` for parameter ``index``'s
    flat elements ``a:b``, found at ``at`` from ``lo``."""
    out = []
    k = max(0, bisect_right(space.starts, lo) - 1)
    while k < len(space.indices) and space.starts[k] < hi:
        start, i = space.starts[k], space.indices[k]
        a, b = max(lo, start), min(hi, start + numels[i])
        if a < b:
            out.append((i, a - start, b - start, a - lo))
        k += 1
    return out
