"""Optimizer state between its sharded form (per piece, on the rank that owns it) and torch's form (per parameter).

An entry is *elementwise* when it is a tensor with the parameter's shape (Adam's ``exp_avg``, SGD's
``momentum_buffer``): it is cut into pieces and glued back. Anything else (``step``, scalars, ``None``) is the same
for every piece of a parameter and is kept once. ``step`` is never elementwise, even for a 0-d parameter, whose
elementwise entries are 0-d too. Part of ``fanfold.optim``; no collective here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layout import Piece

__all__ = ["PieceState", "elementwise", "assemble", "cut"]


@dataclass
class PieceState:
    """One piece's optimizer state, as it travels to the rank that consolidates."""

    index: int
    start: int
    stop: int
    state: dict


def elementwise(key: Any, value: Any, shape: torch.Size) -> bool:
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
            if elementwise(key, parts[0].state[key], piece_shape):
                entry[key] = torch.cat([r.state[key].reshape(-1) for r in parts]).reshape(p.shape)
            else:
                entry[key] = parts[0].state[key]
        if entry:
            full[index] = entry
    return full


def cut(state: dict, piece: Piece, param: torch.Tensor) -> dict:
    """The part of one parameter's torch state that belongs to ``piece``. Tensors are copied: a view would keep the
    full tensor alive, and a shared ``step`` would be counted up by two optimizers."""
    return {k: v.reshape(-1)[piece.start:piece.stop].clone() if elementwise(k, v, param.shape)
            else v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
