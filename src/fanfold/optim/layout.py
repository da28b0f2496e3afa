"""Where each rank's shard lies: members laid end to end in flat spaces cut into equal slices, the pieces of a rank's
slices (one per parameter it touches), and the optimizer state per piece, cut and glued back. No collective."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Piece", "PieceState", "Space", "plan_spaces", "pieces_of", "assemble", "cut"]


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
    """Members ``indices`` of one dtype and device laid end to end (``indices[k]``: ``numels[k]`` elements from
    ``starts[k]``), cut into ``world`` slices of ``shard`` elements (the last ones short or empty); rank r owns slice
    r. ZeRO's flat parameters, or at stage 2 one DDP bucket."""

    dtype: torch.dtype
    device: torch.device
    indices: tuple[int, ...]
    starts: tuple[int, ...]
    numels: tuple[int, ...]
    total: int
    world: int

    @property
    def shard(self) -> int:  # elements per slice: the padded size every rank sends in the all-gather
        return -(-self.total // self.world)

    def slice(self, rank: int) -> tuple[int, int]:
        lo = min(rank * self.shard, self.total)
        return lo, min(lo + self.shard, self.total)

    def spans(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """``(index, a, b, at)``: member ``index``'s elements ``a:b`` under ``lo:hi``, at ``at`` from ``lo``."""
        out, k = [], max(0, bisect_right(self.starts, lo) - 1)
        while k < len(self.indices) and self.starts[k] < hi:
            start = self.starts[k]
            a, b = max(lo, start), min(hi, start + self.numels[k])
            if a < b:
                out.append((self.indices[k], a - start, b - start, a - lo))
            k += 1
        return out


def laid_end_to_end(dtype: torch.dtype, device: torch.device, indices: list[int], numels: list[int],
                    world: int) -> Space:
    starts = [sum(numels[:k]) for k in range(len(numels))]
    return Space(dtype, device, tuple(indices), tuple(starts), tuple(numels), sum(numels), world)


def plan_spaces(params: list[torch.Tensor], world: int) -> list[Space]:
    """One :class:`Space` per (dtype, device), in order of first appearance; parameters keep their order."""
    members: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        members.setdefault((p.dtype, p.device), []).append(i)
    return [laid_end_to_end(dtype, device, idx, [params[i].numel() for i in idx], world)
            for (dtype, device), idx in members.items()]


def pieces_of(spaces: list[Space], groups: list[int], rank: int) -> list[Piece]:
    """The pieces of rank ``rank``'s slices, in member order within each space; ``groups[i]``: parameter i's group."""
    return [Piece(i, groups[i], s, a, b, at) for s, space in enumerate(spaces) for i, a, b, at in
            space.spans(*space.slice(rank))]


@dataclass
class PieceState:  # one piece's optimizer state, as it travels between ranks
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
        piece_shape = torch.Size([parts[0].stop - parts[0].start])
        full[index] = {key: torch.cat([r.state[key].reshape(-1) for r in parts]).reshape(params[index].shape)
                       if _elementwise(key, value, piece_shape) else value
                       for key, value in parts[0].state.items()}
    return full


def cut(state: dict, piece: Piece, param: torch.Tensor) -> dict:
    """``piece``'s part of one parameter's torch state, copied: a view would keep the full tensor alive, and a shared
    ``step`` would be counted up by two optimizers."""
    return {k: v.reshape(-1)[piece.start:piece.stop].clone() if _elementwise(k, v, param.shape)
            else v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
