"""Double backward through CPU replicas (``create_graph=True``, a gradient penalty): the replicas' gradients rebuilt
as a differentiable graph by running each replica's forward again on the caller's thread.

Used by ``parallel_backward``, whose worker threads build no graph that a second backward could go through.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from .._core.tree import flatten
from .parallel_apply import _call

__all__ = ["leaf_tensor", "recompute_backward"]


def leaf_tensor(leaf: Any) -> torch.Tensor | None:
    """The tensor a leaf carries (a PackedSequence's data), or None."""
    if isinstance(leaf, PackedSequence):
        return leaf.data
    return leaf if isinstance(leaf, torch.Tensor) else None


def recompute_backward(plan: dict, outs: Sequence[torch.Tensor], grads: Sequence) -> list:
    """The Function's gradients as a differentiable graph (double backward): each replica's forward is run again on
    the caller's thread on the real arguments and parameters (as ``parallel_backward=False`` runs it), its buffers
    left as they were, and its outputs checked against the first forward's (a random op, such as dropout, drawing
    again would give the gradient of another function)."""
    warnings.warn("DataParallel: double backward (create_graph=True) through CPU replicas: their forward is run "
                  "again on the caller's thread to build a differentiable graph (slower; parallel_backward=False "
                  "avoids the recomputation)", stacklevel=3)
    recomputed = []
    for i, (module, args, kwargs, device) in enumerate(zip(plan["modules"], plan["inputs"], plan["kwargs"],
                                                            plan["devices"])):
        for m, key, p in plan["restore"][i]:
            setattr(m, key, p)
        # the run writes into copies of the buffers (BatchNorm's statistics were updated by the first forward);
        # swapped, not restored in place, because its graph may save them
        kept = [(m, key, b) for m in module.modules() for key, b in m._buffers.items() if b is not None]
        for m, key, b in kept:
            m._buffers[key] = b.clone()
        try:
            out = _call(module, args, kwargs, device, plan["state"])
        finally:
            for m, key, b in kept:
                m._buffers[key] = b
        leaves, _ = flatten(out, "output")
        recomputed.extend(t for t in (leaf_tensor(v) for _, v in leaves) if t is not None)
    for i, (start, stop) in enumerate(plan["output_slices"]):
        for a, b in zip(outs[start:stop], recomputed[start:stop]):
            if a.shape != b.shape or not torch.allclose(a.detach(), b.detach(), rtol=1e-4, atol=1e-5, equal_nan=True):
                raise RuntimeError(
                    f"DataParallel: double backward (create_graph=True) runs replica {i}'s forward again, and its "
                    "outputs changed (a random op such as dropout?); create the model with "
                    "DataParallel(..., parallel_backward=False) to keep the first forward's graph")
    pairs = [(o, g) for o, g in zip(recomputed, grads) if g is not None and o.requires_grad]
    targets = list(plan["originals"]) + list(plan["shared_tensors"])
    if not pairs:
        return [None] * len(targets)
    return list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], create_graph=True,
                                    allow_unused=True))
