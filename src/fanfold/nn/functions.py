"""SyncBatchNorm's numerics, no communication: each part's moments packed as one vector ``[n*mean | n*(var + mean^2) |
n]`` (parts combine by summing them), and the autograd Functions that normalise with the whole batch's statistics and
differentiate exactly. Formulas and numerics: docs/syncbn.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the mean and variance handed to the normalisation: float32 for half-precision inputs."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the packed vectors: float64, except where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def pack_moments(x: torch.Tensor) -> torch.Tensor:
    """This part's packed vector (float64, on ``x``'s device); all zeros for an empty part. Not differentiable: the
    gradient through the statistics is the autograd Functions' business; a graph here would join the replicas'
    graphs behind their backs."""
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
    guess = data.sum([0, *range(2, data.dim())]).div_(n)  # a float32 sum: off by its own rounding when |mean| >> std
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
    """The whole batch's per-channel ``count`` (batch x spatial), ``mean`` and biased ``var``."""

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


@dataclass
class StatsPlan:
    """What the Functions need besides tensors: the whole batch's moments and ``eps``, and ``reduce``, which sums
    the backward's packed vector (2C, float64) of this node's parts with every other part's."""

    moments: Moments
    eps: float
    reduce: Callable[[torch.Tensor], torch.Tensor]


def _channels(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _part_sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
               eps: float, need_dx: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(w * invstd * dy if need_dx, sum(dy * xhat), sum(dy))`` over this part, by torch's kernel."""
    if x.numel() == 0:  # the kernel divides by the element count: an empty part contributes nothing
        zeros = var.new_zeros(var.shape)
        return (torch.zeros_like(x) if need_dx else None), zeros, zeros
    # evaluation mode (train=False) on the given statistics. CUDA's kernel wants every optional tensor defined
    # (on an H100 it asserted on None saved statistics, then failed on a None weight): the saved statistics are
    # empty (it then takes the given ones) and a missing weight is ones (the same dx, the same sums)
    saved = mean.new_empty(0)
    if weight is None:
        weight = torch.ones(x.shape[1], dtype=mean.dtype, device=x.device)
    return torch.ops.aten.native_batch_norm_backward(dy, x, weight, mean, var, saved, saved, False, eps,
                                                     [need_dx, True, True])


def _affine_grads(gw: torch.Tensor, gb: torch.Tensor, weight: torch.Tensor | None, need_w: bool,
                  need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    # weight and bias exist together, or the bias alone is absent (bias=False): both take the weight's dtype
    if (need_w or need_b) and gw.dtype != weight.dtype:
        gw, gb = gw.to(weight.dtype), gb.to(weight.dtype)
    return (gw if need_w else None), (gb if need_b else None)


class Normalize(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, plan: StatsPlan) -> torch.Tensor:
        ctx.plan = plan
        ctx.save_for_backward(x, mean, var, weight)
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, plan.eps)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, var, weight = ctx.saved_tensors
        need_x, need_mean, need_var, need_w, need_b = ctx.needs_input_grad[:5]
        eps = ctx.plan.eps
        dx, gw, gb = _part_sums(dy, x, mean, var, weight, eps, need_x)
        dmean = dvar = None
        if need_mean or need_var:
            wide = wide_dtype(var.device)
            invstd = (var.to(wide) + eps).rsqrt()
            scale = invstd if weight is None else invstd * weight.to(wide)
            dmean = (-scale * gb.to(wide)).to(mean.dtype)
            dvar = (scale * invstd * gw.to(wide) * -0.5).to(var.dtype)
        return (dx, dmean, dvar, *_affine_grads(gw, gb, weight, need_w, need_b), None)


class BatchStats(Function):
    @staticmethod
    def forward(ctx: Any, plan: StatsPlan, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = plan.moments
        outs: list[torch.Tensor] = []
        for x in xs:
            dtype = stats_dtype(x)
            outs += [m.mean.to(x.device, dtype), m.var.to(x.device, dtype)]
        ctx.plan = plan
        ctx.save_for_backward(*xs, *outs[0::2])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        n = len(saved) // 2
        xs, means = saved[:n], saved[n:]
        plan: StatsPlan = ctx.plan
        c, home = means[0].numel(), means[0].device
        packed = torch.cat([torch.stack([g.to(home) for g in grads[0::2]]).sum(0),
                            torch.stack([g.to(home) for g in grads[1::2]]).sum(0)]).to(wide_dtype(home))
        total = plan.reduce(packed)  # the backward's one collective: over the ranks, if any
        count = plan.moments.count
        out: list[torch.Tensor | None] = [None]
        for i, (x, mean) in enumerate(zip(xs, means)):
            if not ctx.needs_input_grad[1 + i]:
                out.append(None)
            elif count == 0 or x.numel() == 0:
                out.append(torch.zeros_like(x))
            else:
                a = (total[:c] / count).to(x.device, mean.dtype)
                b = (total[c:] * (2.0 / count)).to(x.device, mean.dtype)
                out.append((x - _channels(mean, x)).mul_(_channels(b, x)).add_(_channels(a, x)).to(x.dtype))
        return tuple(out)


class SyncNormalize(Normalize):
    """``Normalize``'s forward with constant statistics; backward: the whole gradient, one collective."""

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, var, weight = ctx.saved_tensors
        plan: StatsPlan = ctx.plan
        need_x, _, _, need_w, need_b = ctx.needs_input_grad[:5]
        _, gw, gb = _part_sums(dy, x, mean, var, weight, plan.eps, False)
        dx = None
        if need_x:
            total = plan.reduce(torch.cat((gb, gw)).to(wide_dtype(x.device)))  # the backward's one collective
            dx = torch.zeros_like(x) if x.numel() == 0 else _whole_batch_dx(dy, x, mean, var, weight, total, plan)
        return (dx, None, None, *_affine_grads(gw, gb, weight, need_w, need_b), None)


def _whole_batch_dx(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                    weight: torch.Tensor | None, total: torch.Tensor, plan: StatsPlan) -> torch.Tensor:
    """``dx = a * dy + (x - mean) * k1 + k0`` per channel, with ``a = w * invstd``, ``k0 = -a * sum(dy) / M`` and
    ``k1 = -a * invstd * sum(dy * xhat) / M`` from ``total`` = ``[sum(dy) | sum(dy * xhat)]`` over the whole batch.
    Few operations on the per-channel vectors: in a training step each costs several microseconds, about what a
    pass over a small layer's activations costs."""
    invstd = torch.rsqrt(var + plan.eps)
    a = invstd if weight is None else invstd * weight
    coef = torch.cat((a, a * invstd)).div_(-plan.moments.count)
    k0, k1 = total.to(coef.dtype).mul_(coef).view((2, -1) + (1,) * (x.dim() - 2)).unbind(0)
    # in place after x - mean (not x * k1 - mean * k1, which cancels when |mean| >> std); not addcmul(k0, x - mean,
    # k1): its broadcast first operand takes a slow kernel on CPU (5x one in-place pass)
    dx = (x - mean.view(k0.shape)).mul_(k1).addcmul_(dy, a.view(k0.shape)).add_(k0)
    return dx if dx.dtype == x.dtype else dx.to(x.dtype)
