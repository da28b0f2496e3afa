"""Differentiable copies between devices of one process, any device type, a device possibly repeated (``["cpu",
"cpu"]``): ``Broadcast``/``ReduceAdd`` and ``Scatter``/``Gather``, each backward its dual (so higher-order gradients
work). Every forward result is a new tensor, sharing no memory with the inputs.
"""
from __future__ import annotations

import torch
from torch.autograd import Function

from .._core.devices import usable_device, usable_devices


class Broadcast(Function):
    """``Broadcast.apply(devices, *tensors)``: every tensor on every device, device-major (``out[i * len(tensors) + j]``
    is ``tensors[j]`` on ``devices[i]``). Copies of tensors that do not require grad do not require grad."""

    @staticmethod
    def forward(ctx, devices, *tensors):
        ctx.sources = [t.device for t in tensors]
        # copy=True: a new tensor even on its own device, which a replica may then modify in place
        outputs = tuple(t.to(d, copy=True) for d in usable_devices(devices, "devices") for t in tensors)
        frozen = [o for k, o in enumerate(outputs) if not ctx.needs_input_grad[1 + k % len(tensors)]]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        n = len(ctx.sources)
        summed = tuple(
            ReduceAdd.apply(ctx.sources[j], *grads[j::n]) if ctx.needs_input_grad[1 + j] else None for j in range(n)
        )
        return (None, *summed)


class ReduceAdd(Function):
    """``ReduceAdd.apply(destination, *tensors)``: the sum of same-shaped tensors on ``destination``, in list order."""

    @staticmethod
    def forward(ctx, destination, *tensors):
        ctx.sources = [t.device for t in tensors]
        dest = usable_device(destination, "destination")
        out = tensors[0].to(dest, copy=True)
        for t in tensors[1:]:
            out.add_(t.to(dest))
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, *Broadcast.apply(ctx.sources, grad))


class Scatter(Function):
    """``Scatter.apply(devices, chunk_sizes, dim, tensor)``: chunk i of ``tensor`` along ``dim`` on device i."""

    @staticmethod
    def forward(ctx, devices, chunk_sizes, dim, tensor):
        ctx.dim = dim
        ctx.source = tensor.device
        chunks = tensor.split(list(chunk_sizes), dim)
        return tuple(c.to(d, copy=True) for c, d in zip(chunks, usable_devices(devices, "devices")))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, Gather.apply(ctx.source, ctx.dim, *grads)


class Gather(Function):
    """``Gather.apply(destination, dim, *tensors)``: ``tensors`` concatenated along ``dim`` on ``destination``."""

    @staticmethod
    def forward(ctx, destination, dim, *tensors):
        ctx.dim = dim
        ctx.sources = [t.device for t in tensors]
        ctx.sizes = [t.size(dim) for t in tensors]
        dest = usable_device(destination, "destination")
        return torch.cat([t.to(dest) for t in tensors], dim)

    @staticmethod
    def backward(ctx, grad):
        # Scatter's split without its copies or its Function call, as torch.cat's own backward: views on the
        # gradient's device (a gradient is read, never written in place); split and to() are autograd's own ops, so
        # double backward still works
        return (None, None, *(g.to(d) for g, d in zip(grad.split(ctx.sizes, ctx.dim), ctx.sources)))
