"""Deferred BatchNorm (``deferred_batch_norm=True``): in training, each micro-batch is normalised with its own
statistics, as BatchNorm does on any batch it is given, but the running statistics move once per mini-batch, from
the statistics of all its micro-batches together, so that they equal the sequential model's on the whole batch."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredNorms", "refuse_sync_batchnorm"]


def refuse_sync_batchnorm(layers: Sequence[tuple[str, nn.Module]]) -> None:
    """A SyncBatchNorm's forward is a collective over processes; a pipeline's stages run their micro-batches in
    an order of their own, on threads or processes that are not the group's replicas, so it is refused."""
    for name, layer in layers:
        for sub, m in layer.named_modules(prefix=name):
            if isinstance(m, _BatchNorm) and "SyncBatchNorm" in (c.__name__ for c in type(m).__mro__):
                raise TypeError(
                    f"{sub} is a {type(m).__name__}: a pipeline cannot synchronise BatchNorm over processes (its "
                    "stages run micro-batches, not the group's replicas). Use deferred_batch_norm=True for the "
                    "whole mini-batch's running statistics, after fanfold.revert_sync_batchnorm(model)")


def _deferrable(m: nn.Module) -> bool:
    # BatchNorm1d/2d/3d (and subclasses that keep _BatchNorm's forward) that keep running statistics
    return (isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None)


@dataclass
class _Moments:
    """One layer's statistics so far in a mini-batch, per channel: values counted, their mean, and the sum of
    squared deviations from it (combined with Chan's formula: no cancellation as with a sum of squares)."""

    count: int = 0
    mean: torch.Tensor | None = None
    m2: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.size(1)
        var, mean = torch.var_mean(x.detach(), dim=dims, correction=0)
        m2 = var * n
        if self.count == 0:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.m2 = self.m2 + m2 + delta * delta * (self.count * n / total)
        self.mean = self.mean + delta * (n / total)
        self.count = total


class DeferredNorms:
    """The deferrable BatchNorm layers of a pipeline's stages. Inside ``deferred(module)`` (one stage's step, on
    its thread), their training forward normalises with the micro-batch's statistics and records them instead of
    moving the running statistics; ``commit()`` (the pass is over) moves them once, from all micro-batches."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._layers = [m for module in modules for m in module.modules() if _deferrable(m)]
        self._moments: dict[int, _Moments] = {}
        self._paused: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._layers)

    @contextlib.contextmanager
    def deferred(self, module: nn.Module) -> Iterator[None]:
        mine = [m for m in module.modules() if any(m is layer for layer in self._layers) and "forward" not in vars(m)]
        for m in mine:
            m.forward = functools.partial(self._forward, m)
        try:
            yield
        finally:
            for m in mine:
                del m.forward

    @contextlib.contextmanager
    def paused(self, module: nn.Module) -> Iterator[None]:
        """A checkpoint's recomputation: the micro-batch was recorded by its forward already."""
        ids = {id(m) for m in module.modules()} - self._paused
        self._paused |= ids
        try:
            yield
        finally:
            self._paused -= ids

    def _forward(self, m: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        m._check_input_dim(x)
        if not m.training:
            return F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)
        if id(m) not in self._paused:
            self._moments.setdefault(id(m), _Moments()).add(x)
        return F.batch_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)

    def discard(self) -> None:
        self._moments.clear()

    @torch.no_grad()
    def commit(self) -> None:
        """Each layer that saw micro-batches in training: the running statistics of their whole mini-batch, as the
        layer's own forward on it would have moved them."""
        moments, self._moments = self._moments, {}
        for m in self._layers:
            seen = moments.get(id(m))
            if seen is None:
                continue
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
            unbiased = seen.m2 / (seen.count - 1) if seen.count > 1 else torch.full_like(seen.m2, float("nan"))
            # .data: a micro-batch's graph (eval-mode layers) may have saved these; a version bump breaks it
            m.running_mean.data.mul_(1 - factor).add_(seen.mean.to(m.running_mean.dtype), alpha=factor)
            m.running_var.data.mul_(1 - factor).add_(unbiased.to(m.running_var.dtype), alpha=factor)
