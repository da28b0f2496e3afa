"""Where each rank's shard lies: contiguous equal slices of a flat view of all parameters.

The parameters, in optimizer order, are laid end to end, one flat space per (dtype, device) so that a space can be
all-gathered as one tensor. A space of ``T`` elements is cut into ``N`` slices of ``ceil(T / N)`` elements (the last
ones shorter or empty); rank ``r`` owns slice ``r``. A slice may start or end inside a parameter: the part of one
parameter inside one slice is a :class:`Piece`. For the step, pieces are cut further into pieces of at most
``PIECE_BYTES`` (``split_pieces``), batched into parameter groups of about that size (``cache_batches``,
``inner_groups``), so that each pass of the inner optimizer runs over data still in cache. Pure arithmetic, no
collective; part of ``fanfold.optim``.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

__all__ = ["PIECE_BYTES", "Piece", "Space", "plan_spaces", "pieces_of", "spans", "split_pieces", "cache_batches",
           "inner_groups"]

# The most bytes of parameter one piece of the step covers. Adam's passes over a piece touch about four times this
# (parameter, gradient, two state tensors), which stays in the cache of the 2-core VM measured (1 MiB L2 per core,
# 32 MiB L3). Measured alike from 512 KiB to 4 MiB; below 256 KiB the Python overhead of one parameter group per
# piece costs more than the cache saves (benchmarks/zero_step.py, docs/zero.md).
PIECE_BYTES = 512 * 1024


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


def split_pieces(pieces: list[Piece], params: list[torch.Tensor], limit: int = PIECE_BYTES) -> list[Piece]:
    """Each piece cut into pieces of at most ``limit`` bytes (at least one element), in order. The cuts lie at the
    parameter's flat elements that are multiples of ``limit // element size``, so the same elements of a parameter
    form a piece at any world size, wherever the ranks' slices begin."""
    out = []
    for pc in pieces:
        width = max(1, limit // params[pc.index].element_size())
        a = pc.start
        while a < pc.stop:
            b = min(pc.stop, (a // width + 1) * width)
            out.append(Piece(pc.index, pc.group, pc.space, a, b, pc.offset + a - pc.start))
            a = b
    return out


def cache_batches(pieces: list[Piece], params: list[torch.Tensor], limit: int = PIECE_BYTES) -> list[list[int]]:
    """Positions in ``pieces`` batched into runs of consecutive pieces of at most ``limit`` bytes together (a larger
    piece alone)."""
    out: list[list[int]] = []
    used = 0
    for k, pc in enumerate(pieces):
        size = pc.numel * params[pc.index].element_size()
        if not out or used + size > limit:
            out.append([])
            used = 0
        out[-1].append(k)
        used += size
    return out


def inner_groups(pieces: list[Piece], params: list[torch.Tensor],
                 cut: list[bool]) -> tuple[list[Piece], list[tuple[int, list[int]]]]:
    """The inner optimizer's parameters and groups: ``pieces`` in group order, those of group ``g`` cut by
    ``split_pieces`` where ``cut[g]``; and per inner group, its group and its positions in that list: one per cache
    batch of a cut group, one for each other group. A group with no piece on this rank gets one empty inner group,
    which takes the optimizer class's defaults into it as on the other ranks."""
    out: list[Piece] = []
    batches: list[tuple[int, list[int]]] = []
    for g, pieced in enumerate(cut):
        mine = [pc for pc in pieces if pc.group == g]
        runs = [list(range(len(mine)))]
        if pieced:
            mine = split_pieces(mine, params)
            runs = cache_batches(mine, params) or [[]]
        batches += [(g, [len(out) + k for k in run]) for run in runs]
        out += mine
    return out, batches
