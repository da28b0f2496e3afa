"""Micro-batches: split a batch along dim 0, re-join the outputs, and weigh each micro-batch's loss.

The split and the re-join are fanfold's own ``scatter`` and ``gather`` with every chunk on the first stage's device;
sizes follow ``torch.chunk``, so a small batch gives fewer micro-batches, never an empty one or a dropped row.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..parallel.scatter_gather import gather, scatter

__all__ = ["microbatch_sizes", "batch_size", "split", "join", "loss_weights"]


def microbatch_sizes(batch: int, chunks: int) -> list[int]:
    """Rows per micro-batch with ``torch.chunk`` semantics; ``[0]`` for an empty batch."""
    if batch == 0:
        return [0]
    size = math.ceil(batch / chunks)
    return [size] * (batch // size) + ([batch % size] if batch % size else [])


def _tensor_leaves(obj: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, (tuple, list)):
        return [leaf for i, x in enumerate(obj) for leaf in _tensor_leaves(x, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [leaf for k, x in obj.items() for leaf in _tensor_leaves(x, f"{path}[{k!r}]")]
    return []


def batch_size(obj: Any, name: str) -> int:
    """The common size along dim 0 of the tensors in ``obj``; ValueError naming ``name`` if they disagree."""
    leaves = _tensor_leaves(obj, name)
    if not leaves:
        raise ValueError(f"{name} holds no tensor: a pipeline splits its batch along dim 0 into micro-batches")
    first_path, first = leaves[0]
    for path, t in leaves:
        if t.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor: it has no batch dimension to split into micro-batches")
        if t.size(0) != first.size(0):
            raise ValueError(f"{path} has {t.size(0)} rows along dim 0 but {first_path} has {first.size(0)}: every "
                             "tensor of a batch must have the same batch size")
    return first.size(0)


def split(obj: Any, sizes: list[int], device: torch.device) -> list[Any]:
    """``obj`` cut along dim 0 into ``sizes`` rows, every micro-batch on ``device`` (differentiable)."""
    return scatter(obj, [device] * len(sizes), 0, sizes)


def join(outputs: list[Any], device: torch.device) -> Any:
    """The micro-batches' outputs concatenated along dim 0 on ``device`` (differentiable)."""
    for path, t in _tensor_leaves(outputs[0], "output"):
        if t.dim() == 0:
            raise ValueError(f"the last stage returned a 0-dim tensor at {path}: a pipeline's output must keep the "
                             "batch dimension so the micro-batches can be re-joined (reduce it after the pipeline)")
    return gather(outputs, device, 0)


def loss_weights(sizes: list[int], reduction: str) -> list[float]:
    """The factor of each micro-batch's loss so that their sum is the whole batch's loss.

    ``"mean"``: the loss function averages over the batch, so micro-batch m weighs ``rows_m / batch``;
    ``"sum"``: it sums over the batch, so every micro-batch weighs 1.
    """
    if reduction == "sum":
        return [1.0] * len(sizes)
    if reduction == "mean":
        total = sum(sizes)
        return [s / total if total else 1.0 for s in sizes]
    raise ValueError(f'reduction must be "mean" or "sum" (how loss_fn reduces over the batch), got {reduction!r}')
