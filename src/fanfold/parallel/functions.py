"""Differentiable device communication: ``Broadcast``/``ReduceAdd`` and ``Scatter``/``Gather``, autograd Functions in
dual pairs, each backward calling its dual's ``apply`` (so higher-order gradients work too). Any device type,
repeated devices allowed; the data moves are ``comm.py``'s.
"""
from __future__ import annotations

import torch
from torch.autograd import Function

from .._core.devices import normalize_device, normalize_devices
from . import comm


class Broadcast(Function):
    """``Broadcast.apply(devices, *tensors)``: every tensor on every device, device-major.

    Returns ``len(devices) * len(tensors)`` tensors: ``out[i * len(tensors) + j]`` is ``tensors[j]`` on
    ``devices[i]``. Copies of tensors that do not require grad (buffers, frozen parameters) do not require grad.
    """

    @staticmethod
    def forward(ctx, devices, *tensors):
        devs = normalize_devices(devices, "devices")
        ctx.sources = [t.device for t in tensors]
        ctx.num_tensors = len(tensors)
        copies = [comm.broadcast(t, devs) for t in tensors]
        outputs = tuple(copies[j][i] for i in range(len(devs)) for j in range(len(tensors)))
        frozen = [o for k, o in enumerate(outputs) if not ctx.needs_input_grad[1 + k % len(tensors)]]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.num_tensors
        summed = tuple(
            ReduceAdd.apply(ctx.sources[j], *grads[j::n]) if ctx.needs_input_grad[1 + j] else None for j in range(n)
        )
        return (None, *summed)


class ReduceAdd(Function):
    """``ReduceAdd.apply(destination, *tensors)``: the sum of same-shaped tensors on ``destination``."""

    @staticmethod
    def forward(ctx, destination, *tensors):
        ctx.sources = [t.device for t in tensors]
        return comm.reduce_add(tensors, destination)

    @staticmethod
    def backward(ctx, grad):
        return (None, *Broadcast.apply(ctx.sources, grad))


class Scatter(Function):
    """``Scatter.apply(devices, chunk_sizes, dim, tensor)``: chunk i of ``tensor`` along ``dim`` on device i."""

    @staticmethod
    def forward(ctx, devices, chunk_sizes, dim, tensor):
        ctx.dim = dim
        ctx.source = tensor.device
        return tuple(comm.scatter(tensor, devices, chunk_sizes, dim))

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
        return comm.gather(tensors, normalize_device(destination), dim)

    @staticmethod
    def backward(ctx, grad):
        if not torch.is_grad_enabled() and all(s == grad.device for s in ctx.sources):
            # a first-order backward with every replica on the gradient's device: views are enough (nothing
            # writes into incoming gradients), and copying would only cost time
            return (None, None, *grad.split(ctx.sizes, ctx.dim))
        return (None, None, *Scatter.apply(ctx.sources, ctx.sizes, ctx.dim, grad))
