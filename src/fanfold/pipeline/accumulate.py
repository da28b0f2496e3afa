"""Weight gradients of ``nn.Linear`` layers in a pipeline training step: after the input gradients, in place.

In ``stage``'s detached (training) mode, an eligible layer's backward computes only its input gradient and keeps
the micro-batch's rows; ``step()``, called once the stage has sent its input gradients upstream, adds the pending
weight gradients into ``.grad`` with one ``addmm_`` per layer. Eligibility and why: docs/pipeline.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightGradAccumulator"]


def _hooked(p: torch.Tensor | None) -> bool:
    return p is not None and bool(getattr(p, "_backward_hooks", None) or
                                  getattr(p, "_post_accumulate_grad_hooks", None))


def _eligible(m: nn.Module) -> bool:
    if type(m) is not nn.Linear:
        return False
    w, b = m.weight, m.bias
    return (w.is_floating_point() and w.is_contiguous()
            and (b is None or b.dtype == w.dtype) and not _hooked(w) and not _hooked(b))


@dataclass
class _Rows:
    """A layer's output-gradient and input rows waiting for their product."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    grads: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward hands the parameter gradients' rows to ``sink`` and autograd
    none for them (so ``AccumulateGrad`` has nothing to add)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None,
                sink: WeightGradAccumulator) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.sink = (weight, bias), sink  # the parameters themselves: their .grad is what gets written
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.sink.add(*ctx.params, grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1]))
        return grad_x, None, None, None


class WeightGradAccumulator:
    """One stage's pending weight-gradient rows; ``step()`` after each backward step."""

    def __init__(self) -> None:
        self._pending: dict[int, _Rows] = {}

    @contextlib.contextmanager
    def linears(self, module: nn.Module) -> Iterator[None]:
        """While inside, the eligible ``nn.Linear`` layers of ``module`` send their parameter gradients here; their
        ``forward`` is restored on the way out, whatever happens."""
        patched = [m for m in module.modules() if _eligible(m) and "forward" not in vars(m)]
        for m in patched:
            m.forward = self._forward(m, m.forward)
        try:
            yield
        finally:
            for m in patched:
                del m.forward

    def _forward(self, m: nn.Linear, original: Any) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and x.dtype == m.weight.dtype and x.dim() >= 1
                    and not torch.is_autocast_enabled(x.device.type)):
                return original(x)
            return _DeferredLinear.apply(x, m.weight, m.bias, self)
        return forward

    def add(self, weight: nn.Parameter, bias: nn.Parameter | None, grad: torch.Tensor, x: torch.Tensor) -> None:
        pending = self._pending.setdefault(id(weight), _Rows(weight, bias))
        pending.grads.append(grad)
        pending.inputs.append(x)

    def step(self) -> None:
        """Every pending product into ``.grad``: called after a backward step has sent its input gradients on, so
        that these products do not delay the previous stage."""
        while self._pending:
            self._apply(self._pending.popitem()[1])

    @staticmethod
    @torch.no_grad()
    def _apply(rows: _Rows) -> None:
        g = rows.grads[0] if len(rows.grads) == 1 else torch.cat(rows.grads)
        x = rows.inputs[0] if len(rows.inputs) == 1 else torch.cat(rows.inputs)
        w, b = rows.weight, rows.bias
        if w.requires_grad:
            if w.grad is None:
                w.grad = g.t().mm(x)
            elif w.grad.is_contiguous() and w.grad.dtype == g.dtype:
                w.grad.addmm_(g.t(), x)  # the product accumulates where it is written: no temporary
            else:
                w.grad.add_(g.t().mm(x))
        if b is not None and b.requires_grad:
            if b.grad is None:
                b.grad = g.sum(0)
            else:
                b.grad.add_(g.sum(0))
