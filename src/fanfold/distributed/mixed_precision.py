"""torch's ``mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` for DistributedDataParallel:
forward and backward on low-precision copies of the parameters, full-precision masters and ``.grad`` outside them.
On any device (torch's needs CUDA streams); the differences from torch: docs/ddp-compat.md.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._core.tree import flatten, unflatten

__all__ = ["MixedPrecision"]


def _dtype(config: Any, name: str) -> torch.dtype | None:
    value = getattr(config, name, None)
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"mixed_precision.{name} must be None or a floating-point torch.dtype, got {value!r}")
    return value


class MixedPrecision:
    """Low-precision copies of ``module``'s parameters during forward and backward; the masters otherwise."""

    def __init__(self, config: Any, module: nn.Module):
        if not all(hasattr(config, a) for a in ("param_dtype", "reduce_dtype", "buffer_dtype")):
            raise TypeError("mixed_precision must be torch.nn.parallel.distributed._MixedPrecision (or have "
                            f"param_dtype, reduce_dtype and buffer_dtype), got {config!r}")
        self.param_dtype = _dtype(config, "param_dtype")
        self.reduce_dtype = _dtype(config, "reduce_dtype") or self.param_dtype
        self.buffer_dtype = _dtype(config, "buffer_dtype")
        self.module = module
        self._masters: list[tuple[nn.Parameter, torch.Tensor]] | None = None
        self._graph = False  # a forward with grad ran on the copies: its backward needs them

    def cast_buffers(self) -> None:
        if self.buffer_dtype is None:
            return
        for buf in self.module.buffers():
            if buf.is_floating_point():
                buf.data = buf.data.to(self.buffer_dtype)

    def cast_params(self) -> None:
        """Before a forward: every parameter's data becomes a low-precision copy of its master (kept once, so a
        second forward before the backward copies the same masters); before one with grad, an accumulated gradient
        is cast down too, as torch does, since the backward accumulates into it (one without grad leaves it)."""
        if self.param_dtype is None:
            return
        grad = torch.is_grad_enabled()
        self._graph = self._graph or grad
        if self._masters is None:
            self._masters = [(p, p.data) for p in self.module.parameters()]
        with torch.no_grad():
            for p, master in self._masters:
                p.data = master.to(self.param_dtype)
                if grad and p.grad is not None and p.grad.dtype != self.param_dtype:
                    p.grad = p.grad.to(self.param_dtype)

    def cast_inputs(self, inputs: Any) -> Any:
        if self.param_dtype is None:
            return inputs
        leaves, spec = flatten(inputs)
        return unflatten(spec, [x.to(self.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                                else x for _, x in leaves])

    def restore_unless_needed(self) -> None:
        """After a forward without grad: the masters back, unless an earlier forward's backward still needs the
        low-precision copies (its saved tensors are the parameters themselves)."""
        if not self._graph:
            self.restore()

    def restore(self) -> None:
        """The masters back; a low-precision gradient becomes full precision. Idempotent."""
        self._graph = False
        if self._masters is None:
            return
        with torch.no_grad():
            for p, master in self._masters:
                p.data = master
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
        self._masters = None
