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


def _copies(tensors: list[torch.Tensor], devices: list[torch.device], detach: bool, shared: bool) -> list[list]:
    """``out[j][k]``: what replica j uses for ``tensors[k]``: on its own device the tensor itself (parameters,
    ``shared``: for every replica there; buffers: for the first one only), else a copy (parameters: one per device;
    buffers: one per replica, which it may modify in place)."""
    out = [[t.detach() if detach and shared else t for t in tensors] for _ in devices]
    by_source: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        by_source.setdefault(t.device, []).append(k)
    for source, ks in by_source.items():
        if shared:
            targets = list(dict.fromkeys(d for d in devices if d != source))  # distinct, in order
            slot = {j: targets.index(d) for j, d in enumerate(devices) if d != source}
        else:
            owner = devices.index(source) if source in devices else None
            slot = {j: i for i, j in enumerate(j for j in range(len(devices)) if j != owner)}
            targets = [devices[j] for j in slot]
        if not targets:
            continue
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
            flat = Broadcast.apply(targets, *[tensors[k] for k in ks])  # device-major: flat[i * len(ks) + n]
        for j, i in slot.items():
            for n, k in enumerate(ks):
                out[j][k] = flat[i * len(ks) + n]
    return out


def replicate(network: M, devices: Sequence[DeviceLike], detach: bool = False) -> list[M]:
    """One replica of ``network`` per entry of ``devices`` (a device may repeat: ``["cpu", "cpu"]``)."""
    if not isinstance(network, nn.Module):
        raise TypeError(f"replicate: network must be an nn.Module, got {type(network).__name__}")
    devs = usable_devices(devices, "devices")
    modules = list(network.modules())
    for m in modules:
        # a ScriptModule's children are compiled code: they cannot be re-linked to Python replicas
        if isinstance(m, torch.jit.ScriptModule) and any(
                not isinstance(c, torch.jit.ScriptModule) for c in m.modules()):
            name = next(n for n, x in network.named_modules() if x is m) or "the network"
            raise RuntimeError(f"replicate: cannot replicate {name}: a ScriptModule with Python submodules")
    params = list(network.parameters())
    buffers = list(network.buffers())
    param_copies = _copies(params, devs, detach, shared=True)
    buffer_copies = _copies(buffers, devs, detach, shared=False)
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
