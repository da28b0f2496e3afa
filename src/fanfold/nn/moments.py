"""Batch moments of a batch split into parts (ranks, replicas): each part's contribution as one packed vector.

Bottom of ``fanfold.nn``: tensors in, tensors out, no communication. A part packs, per channel, its sample count
times its mean and its sum of squares about zero, both in float64, plus its count: ``[n*mean | n*(var + mean^2) |
n]``, 2C+1 numbers. Parts are combined by summing these vectors (one all-reduce SUM over ranks, a loop over
replicas), which every transport does, in any order.

Numerics: a sum of squares in float32 loses everything when |mean| >> std (E[x^2] - E[x]^2 cancels). Here each
part computes its own mean and centred sum of squares with the corrected two-pass algorithm (a float32 mean, then
the sums of the deviations from it and of their squares: the first corrects the mean for the rounding of the
second, in float32 with no cancellation), and only the exchange of these moments goes through E[x^2] - E[x]^2, in
float64, where the cancellation costs (mean/std)^2 * 1e-16 relative: negligible below |mean|/std ~ 1e5, past which
float32 data cannot resolve its own variance anyway. Chan's pairwise update would avoid even that, but needs the global mean
first (a second collective) or an all-gather of every part's moments (a message that grows with the world size);
float64 sums keep one fixed-size all-reduce.
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
    """This part's packed vector (float64, on ``x``'s device); all zeros for an empty part."""
    c = x.shape[1]
    n = x.numel() // c if c else 0
    out = torch.zeros(2 * c + 1, dtype=wide_dtype(x.device), device=x.device)
    if n == 0:
        return out
    data = x if x.dtype == stats_dtype(x) else x.to(stats_dtype(x))
    dims = reduce_dims(x)
    guess = data.sum(dims).div_(n)  # a float32 sum: off by its own rounding when |mean| >> std
    d = data - guess.view([1, c] + [1] * (x.dim() - 2))
    s1 = d.sum(dims).to(out.dtype)  # the corrected two-pass algorithm: the guess's error, then the centred squares
    s2 = d.square_().sum(dims).to(out.dtype)
    mean = guess.to(out.dtype) + s1 / n
    out[:c] = mean * n
    out[c: 2 * c] = (s2 - s1.square() / n) + mean.square() * n
    out[2 * c] = n
    return out


@dataclass
class Moments:
    """The whole batch's moments per channel: ``count`` samples (batch x spatial), biased ``var``, float64."""

    count: int
    mean: torch.Tensor
    var: torch.Tensor

    def unbiased_var(self) -> torch.Tensor:
        return self.var * (self.count / (self.count - 1))


def unpack_moments(total: torch.Tensor) -> Moments:
    """The moments of the parts whose packed vectors sum to ``total``."""
    c = (total.numel() - 1) // 2
    count = int(round(total[2 * c].item()))
    if count == 0:
        zeros = torch.zeros(c, dtype=total.dtype, device=total.device)
        return Moments(0, zeros, zeros.clone())
    mean = total[:c] / count
    var = (total[c: 2 * c] / count - mean.square()).clamp_(min=0)
    return Moments(count, mean, var)
