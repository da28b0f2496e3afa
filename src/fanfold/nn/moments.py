"""Batch moments of a batch split into parts (ranks, replicas): each part's contribution as one packed vector.

Tensors in, tensors out, no communication. A part packs, per channel, ``[n*mean | n*(var + mean^2) | n]`` in float64
(2C+1 numbers), its mean and variance computed exactly; parts combine by summing these vectors (one all-reduce SUM).
Why this form: docs/syncbn.md, "Numerics" and "Design notes".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Moments", "reduce_dims", "stats_dtype", "wide_dtype", "pack_moments", "unpack_moments"]


def reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels (dim 1): batch and spatial."""
    return [0] + list(range(2, x.dim()))


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the mean and variance handed to the normalisation: float32 for half-precision inputs."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the packed vectors: float64, except where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def pack_moments(x: torch.Tensor) -> torch.Tensor:
    """This part's packed vector (float64, on ``x``'s device); all zeros for an empty part. Not differentiable: the
    gradient through the statistics is the autograd Functions' business (``functions.py``); a graph here would
    join the replicas' graphs behind their backs."""
    x = x.detach()  # no graph from here on; cheaper than a no_grad context in every training forward
    c = x.shape[1]
    n = x.numel() // c if c else 0
    wide = wide_dtype(x.device)
    if n == 0:
        return torch.zeros(2 * c + 1, dtype=wide, device=x.device)
    data = x if x.dtype == stats_dtype(x) else x.to(stats_dtype(x))
    if data.is_contiguous() and data.device.type == "cpu":
        # plain BatchNorm's own statistics kernel, in one call: exact on contiguous CPU inputs (variance to 2e-7 at
        # |mean|/std = 1e4); not its channels-last path (89x the variance there), nor elsewhere untested
        mean, var = torch.batch_norm_update_stats(data, None, None, 0.0)
    else:
        mean, var = _two_pass(data, n, wide)
    # [n*mean | n*(var + mean^2) | n] in five small operations (addcmul widens var, exactly, by type promotion):
    # this runs in every training forward, where each small operation costs several microseconds
    mean = mean.to(wide)
    return torch.cat((mean, torch.addcmul(var, mean, mean), mean.new_ones(1))).mul_(n)


def _two_pass(data: torch.Tensor, n: int, wide: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel (``wide``) by the corrected two-pass algorithm."""
    c = data.shape[1]
    guess = data.sum(reduce_dims(data)).div_(n)  # a float32 sum: off by its own rounding when |mean| >> std
    d = data - guess.view([1, c] + [1] * (data.dim() - 2))
    # sum(d^2) and sum(d) in one pass over d: torch's BatchNorm-backward kernel returns sum(dy * (x - mean) * invstd)
    # and sum(dy) per channel, here with dy = x = d, mean 0 and invstd exactly 1 (var 0, eps 1); the saved
    # statistics are empty and the weight ones, not None (CUDA's kernel wants every optional tensor defined)
    zeros, ones, saved = guess.new_zeros(c), guess.new_ones(c), guess.new_empty(0)
    _, s2, s1 = torch.ops.aten.native_batch_norm_backward(d, d, ones, zeros, zeros, saved, saved, False, 1.0,
                                                          [False, True, True])
    g, s1, s2 = torch.stack([guess, s1, s2]).to(wide).unbind()
    return g + s1 / n, (s2 - s1.square() / n) / n  # the guess corrected by the mean deviation


@dataclass
class Moments:
    """The whole batch's moments per channel: ``count`` samples (batch x spatial); ``mean`` and biased ``var`` in
    ``dtype`` (what the normalisation takes)."""

    count: int
    mean: torch.Tensor
    var: torch.Tensor


def unpack_moments(total: torch.Tensor, dtype: torch.dtype) -> Moments:
    """The moments of the parts whose packed vectors sum to ``total``."""
    c = (total.numel() - 1) // 2
    count = int(total[2 * c])
    if count == 0:
        zeros = total.new_zeros(c, dtype=dtype)
        return Moments(0, zeros, zeros)
    # [E[x] | E[x^2] | 1] in float64, then E[x^2] - E[x]^2 in place: few small ops, as this runs every training step
    both = total / count
    mean, var, _ = both.split_with_sizes((c, c, 1))
    var.addcmul_(mean, mean, value=-1).clamp_(min=0)
    if dtype != both.dtype:
        mean, var, _ = both.to(dtype).split_with_sizes((c, c, 1))
    return Moments(count, mean, var)
