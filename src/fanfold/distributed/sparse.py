"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) averaged across ranks.

Used by the reducer (``reducer.py``) at the end of a synchronised backward; built on the transport interface's
``all_reduce`` alone (``collectives``), so it works on every transport. A sparse gradient cannot share a flat
bucket: each rank's (row indices, row values) are gathered from every rank -- zero-padded tables that only their
owner fills, summed, so the gather is exact -- concatenated in rank order, coalesced (rows that several ranks
touched are summed) and divided by the divisor. Every rank builds the same tensor in the same order, so the result
is bitwise the same on every rank. Four small all-reduces per sparse parameter, issued in parameter order.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_gather_varlen", "all_reduce_sparse", "empty_sparse_like"]


def all_gather_varlen(transport: Any, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` by rank: same dtype and trailing shape everywhere, any length along dim 0."""
    counts = torch.zeros(transport.world_size, dtype=torch.int64, device=tensor.device)
    counts[transport.rank] = tensor.shape[0]
    transport.all_reduce(counts).wait()
    lengths = counts.tolist()
    table = torch.zeros((transport.world_size, max(lengths), *tensor.shape[1:]), dtype=tensor.dtype,
                        device=tensor.device)
    table[transport.rank, : tensor.shape[0]] = tensor
    transport.all_reduce(table).wait()  # x + 0 is x: only the owner fills its row
    return [table[r, :n] for r, n in enumerate(lengths)]


def empty_sparse_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``param`` with no rows: what a rank that did not use the parameter contributes."""
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64, device=param.device),
                                   torch.zeros(0, *param.shape[1:], dtype=param.dtype, device=param.device),
                                   param.shape, check_invariants=False)


def all_reduce_sparse(transport: Any, grad: torch.Tensor, divisor: float) -> torch.Tensor:
    """The sum over ranks of the sparse ``grad`` (one sparse dimension, as embeddings give), divided by
    ``divisor``, coalesced."""
    grad = grad.coalesce()
    indices = all_gather_varlen(transport, grad.indices().t().contiguous())
    values = all_gather_varlen(transport, grad.values().contiguous())
    # the rows come from valid gradients: no invariant check (torch would warn that it skips it)
    total = torch.sparse_coo_tensor(torch.cat(indices).t(), torch.cat(values), grad.shape,
                                    check_invariants=False).coalesce()
    return torch.sparse_coo_tensor(total.indices(), total.values().div_(divisor), grad.shape,
                                   is_coalesced=True, check_invariants=False)
