"""replicate(network, devices, detach=False): one cheap replica of a module per device, for one forward pass; and
``link_replicas`` for replicas that work together during it (SyncBatchNorm).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from .._core.devices import DeviceLike, usable_devices
from .functions import Broadcast

M = TypeVar("M", bound=nn.Module)


def _check_replicable(network: nn.Module) -> None:
    # a ScriptModule's children are compiled code: they cannot be re-linked to Python replicas
    for m in network.modules():
        if isinstance(m, torch.jit.ScriptModule) and any(
                not isinstance(c, torch.jit.ScriptModule) for c in m.modules()):
            name = next(n for n, x in network.named_modules() if x is m) or "the network"
            raise RuntimeError(f"replicate: cannot replicate {name}: a ScriptModule with Python submodules")


def _param_copies(params: list[torch.Tensor], devices: list[torch.device], detach: bool) -> list[list[torch.Tensor]]:
    """``out[j][k]``: what replica j uses for ``params[k]``: the parameter itself on its own device, else a copy."""
    out: list[list] = [list(params) if not detach else [p.detach() for p in params] for _ in devices]
    by_source: dict[torch.device, list[int]] = {}
    for k, p in enumerate(params):
        by_source.setdefault(p.device, []).append(k)
    for source, ks in by_source.items():
        targets = list(dict.fromkeys(d for d in devices if d != source))  # distinct, in order
        if not targets:
            continue
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
            flat = Broadcast.apply(targets, *[params[k] for k in ks])  # device-major: flat[i * len(ks) + k]
        where = {d: i for i, d in enumerate(targets)}
        for j, d in enumerate(devices):
            if d in where:
                for n, k in enumerate(ks):
                    out[j][k] = flat[where[d] * len(ks) + n]
    return out


def _buffer_copies(buffers: list[torch.Tensor], devices: list[torch.device], detach: bool) -> list[list[torch.Tensor]]:
    """``out[j][k]``: replica j's own copy of ``buffers[k]`` (the original for the first replica on its device)."""
    out: list[list] = [[None] * len(buffers) for _ in devices]
    for k, b in enumerate(buffers):
        owner = next((j for j, d in enumerate(devices) if d == b.device), None)
        others = [d for j, d in enumerate(devices) if j != owner]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
            it = iter(Broadcast.apply(others, b) if others else ())
        for j in range(len(devices)):
            out[j][k] = b if j == owner else next(it)
    return out


def replicate(network: M, devices: Sequence[DeviceLike], detach: bool = False) -> list[M]:
    """One replica of ``network`` per entry of ``devices`` (a device may repeat: ``["cpu", "cpu"]``)."""
    if not isinstance(network, nn.Module):
        raise TypeError(f"replicate: network must be an nn.Module, got {type(network).__name__}")
    devs = usable_devices(devices, "devices")
    _check_replicable(network)

    modules = list(network.modules())
    params = list(network.parameters())
    buffers = list(network.buffers())
    param_copies = _param_copies(params, devs, detach)
    buffer_copies = _buffer_copies(buffers, devs, detach)
    param_index = {id(p): k for k, p in enumerate(params)}
    buffer_index = {id(b): k for k, b in enumerate(buffers)}
    module_index = {id(m): i for i, m in enumerate(modules)}

    replicas = []
    for j in range(len(devs)):
        copies = [m._replicate_for_data_parallel() for m in modules]
        for m, r in zip(modules, copies):
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else copies[module_index[id(child)]]
            for key, p in m._parameters.items():
                if p is None:
                    r._parameters[key] = None
                    continue
                # setattr: nn.LSTM's _flat_weights see the copy; a copy (not a leaf) is a plain attribute, as in torch
                setattr(r, key, param_copies[j][param_index[id(p)]])
            for key, b in m._buffers.items():
                r._buffers[key] = None if b is None else buffer_copies[j][buffer_index[id(b)]]
        replicas.append(copies[0])
    return replicas


@runtime_checkable
class LinkedReplicas(Protocol):
    """A module whose replicas work together during a forward (and its backward)."""

    def link_replicas(self, replicas: list[nn.Module], concurrent_backward: bool, name: str = "") -> None:
        """Called on the original module with its replicas, in replica order, before they run;
        ``concurrent_backward``: each replica's backward will run in its own thread at the same time."""


def link_replicas(network: nn.Module, replicas: Sequence[nn.Module], concurrent_backward: bool) -> None:
    """Introduce the replicas of every ``LinkedReplicas`` submodule of ``network`` to each other."""
    for (name, original), *copies in zip(network.named_modules(), *(r.modules() for r in replicas)):
        if isinstance(original, LinkedReplicas):
            original.link_replicas(list(copies), concurrent_backward, name)
