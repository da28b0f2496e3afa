"""ZeRO stage 2 on the optimizer's side: the pieces of a ``ZeroRedundancyOptimizer`` laid out after DDP's buckets,
so that each rank steps exactly the part of every bucket whose averaged gradient the reducer left it.

Part of ``fanfold.optim``; the reducer's side is ``fanfold.distributed.sharded_grads`` (``GradientShards``), which
this module reads: the bucket layout (``BucketShard``: members, offsets, this rank's ``lo:hi``) and, at each step,
the gradient parts. Pure arithmetic and checks; no collective here.
"""
from __future__ import annotations

from typing import Any

import torch

from .layout import Piece

__all__ = ["check_shards", "bucket_pieces"]


def check_shards(shards: Any, params: list[torch.Tensor], rank: int, world_size: int) -> list[int]:
    """The optimizer's index of each of the reducer's parameters; ValueError unless both hold the same parameters
    over the same ranks."""
    if (shards.rank, shards.world_size) != (rank, world_size):
        raise ValueError(f"ZeroRedundancyOptimizer (rank {rank} of {world_size}): the DistributedDataParallel is rank "
                         f"{shards.rank} of {shards.world_size}; both must use the same process group")
    index = {id(p): k for k, p in enumerate(params)}
    if len(index) != len(params):
        raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): a parameter appears twice in the optimizer")
    mine = [index.get(id(p)) for p in shards.params]
    missing = [k for k, m in enumerate(mine) if m is None]
    if missing or len(shards.params) != len(params):
        extra = sorted(set(range(len(params))) - {m for m in mine if m is not None})
        raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): sharded gradients need the optimizer over exactly "
                         f"the DistributedDataParallel's trainable parameters; {len(missing)} of DDP's are not in the "
                         f"optimizer, and optimizer parameters {extra[:10]} are not trained by DDP")
    return mine


def bucket_pieces(shards: Any, opt_index: list[int], groups: list[int]) -> list[Piece]:
    """This rank's pieces, bucket by bucket: ``Piece.space`` is the bucket, ``Piece.offset`` the place in this rank's
    part of it (what ``GradientShards.grad`` takes)."""
    out = []
    for s in shards.layout:
        for k, a, b, at in s.spans(s.lo, s.hi):
            i = opt_index[s.members[k]]
            out.append(Piece(i, groups[i], s.index, a, b, at))
    return out
