"""Where each rank's shard lies (equal slices of the flat parameters, cut in cache-sized pieces), and the optimizer
state per piece: cut from torch's per-parameter form and glued back.

The parameters, in optimizer order, are laid end to end, one flat space per (dtype, device). A space of ``T``
elements is cut into ``N`` slices of ``ceil(T / N)`` (the last ones shorter or empty); rank ``r`` owns slice ``r``.
The part of one parameter inside one slice is a :class:`Piece`. Torch's elementwise optimizers (``PIECEWISE``) step
pieces of at most ``PIECE_BYTES``, batched into parameter groups of about that size, so that each pass of the update
runs over data still in cache (docs/zero.md). Pure arithmetic, no collective.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PIECE_BYTES", "NOT_ELEMENTWISE", "PIECEWISE", "Piece", "PieceState", "Space", "plan_spaces", "pieces_of",
           "spans", "split_pieces", "cache_batches", "inner_groups", "check_elementwise", "steps_in_pieces",
           "assemble", "cut"]

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


# torch optimizers whose update of one element depends on other elements of the same parameter (matrix
# factorisations, line searches, sparse rows): a slice of a parameter would not step as the whole parameter does.
# Every other class is taken at its word, as torch's ZeroRedundancyOptimizer does.
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
# torch optimizers that also step pieces, each batch of them in a group of its own: elementwise, and every
# per-parameter scalar (``step``, ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``) advances alike for every piece
# (read in each class's update). Matched by exact type: a subclass may override ``step``, so it steps whole.
PIECEWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "ASGD")


def check_elementwise(optimizer_class: type) -> None:
    """ValueError for the torch optimizers that cannot step slices of parameters."""
    bad = [n for n in NOT_ELEMENTWISE if getattr(torch.optim, n, None) is optimizer_class]
    if bad:
        raise ValueError(f"ZeroRedundancyOptimizer: {bad[0]} does not update each element independently, so "
                         f"it cannot step slices of parameters")


def steps_in_pieces(optimizer_class: type, options: Mapping[str, Any]) -> bool:
    """Whether ``optimizer_class`` steps a parameter group with these ``options`` (the user's defaults and the
    group's own) in cache-sized pieces: one of torch's own ``PIECEWISE`` classes exactly, not fused."""
    known = any(getattr(torch.optim, n, None) is optimizer_class for n in PIECEWISE)
    return known and not options.get("fused")


@dataclass
class PieceState:
    """One piece's optimizer state, as it travels to the rank that consolidates."""

    index: int
    start: int
    stop: int
    state: dict


def _elementwise(key: Any, value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape


def assemble(records: list[PieceState], params: list[torch.Tensor]) -> dict[int, dict]:
    """torch's per-parameter ``state`` (keyed by parameter index) from every rank's pieces."""
    by_param: dict[int, list[PieceState]] = {}
    for r in records:
        by_param.setdefault(r.index, []).append(r)
    full: dict[int, dict] = {}
    for index in sorted(by_param):
        parts = sorted(by_param[index], key=lambda r: r.start)
        if not any(r.state for r in parts):
            continue
        if any(set(r.state) != set(parts[0].state) for r in parts):
            raise RuntimeError(f"ZeroRedundancyOptimizer: the shards of parameter {index} disagree on their state "
                               f"({[sorted(r.state) for r in parts]}); some rank stepped it and another did not")
        p = params[index]
        entry = {}
        for key in parts[0].state:
            piece_shape = torch.Size([parts[0].stop - parts[0].start])
            if _elementwise(key, parts[0].state[key], piece_shape):
                entry[key] = torch.cat([r.state[key].reshape(-1) for r in parts]).reshape(p.shape)
            else:
                entry[key] = parts[0].state[key]
        if entry:
            full[index] = entry
    return full


def cut(state: dict, piece: Piece, param: torch.Tensor) -> dict:
    """The part of one parameter's torch state that belongs to ``piece``. Tensors are copied: a view would keep the
    full tensor alive, and a shared ``step`` would be counted up by two optimizers."""
    return {k: v.reshape(-1)[piece.start:piece.stop].clone() if _elementwise(k, v, param.shape)
            else v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
