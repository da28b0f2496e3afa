"""Converting a model's BatchNorm layers to fanfold's SyncBatchNorm and back (``syncbn.py``'s ``convert_sync_batchnorm``
and ``revert_sync_batchnorm``). Both directions hand the new layer the old one's parameter and buffer *objects*, so
an optimizer made before keeps working and the state dict keys do not change; the way back gives each layer the torch
class it was converted from, or ``_BatchNormNd`` (any input of at least 2 dimensions) when nothing records one.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

__all__ = ["convert", "rebuild_plain"]

_TORCH_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class _BatchNormNd(_BatchNorm):
    """Plain BatchNorm over inputs of any dimension >= 2 (what a reverted SyncBatchNorm of unknown origin becomes)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions, got shape {tuple(input.shape)}")


def _rebuild(old: _BatchNorm, cls: type, name: str, **extra: Any) -> _BatchNorm:
    """A ``cls`` layer with ``old``'s settings, holding ``old``'s very parameters and buffers."""
    if isinstance(old, LazyModuleMixin) and old.has_uninitialized_params():
        raise ValueError(f"{name or 'the module'} is a lazy BatchNorm that has not seen an input yet: run one "
                         "forward before converting it")
    bias = old.bias is not None or not old.affine
    new = cls(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats, device="meta",
              **({} if bias else {"bias": False}), **extra)
    for key in new._parameters:
        new._parameters[key] = old._parameters[key]
    for key in new._buffers:
        new._buffers[key] = old._buffers[key]
    new.training = old.training
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    return new


def _replace(module: nn.Module, swap: Any, prefix: str = "") -> nn.Module:
    new = swap(module, prefix)
    for name, child in list(module.named_children()):
        new.add_module(name, _replace(child, swap, f"{prefix}.{name}" if prefix else name))
    return new


def convert(module: nn.Module, cls: type, process_group: Any = None) -> nn.Module:
    """Every ``_BatchNorm`` of ``module`` that is not a ``cls`` becomes one (see ``SyncBatchNorm``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm: module must be an nn.Module, got {type(module).__name__}")

    def swap(m: nn.Module, name: str) -> nn.Module:
        if not isinstance(m, _BatchNorm) or isinstance(m, cls):
            return m
        new = _rebuild(m, cls, name, process_group=process_group)
        new.converted_from = next((c for c in _TORCH_CLASSES if isinstance(m, c)), None)
        return new

    return _replace(module, swap)


def rebuild_plain(module: nn.Module, is_sync: Any) -> nn.Module:
    """``module`` with every layer for which ``is_sync`` holds replaced by the plain BatchNorm it was converted
    from (``converted_from``), else one for any input dimension."""

    def swap(m: nn.Module, name: str) -> nn.Module:
        if not is_sync(m):
            return m
        return _rebuild(m, getattr(m, "converted_from", None) or _BatchNormNd, name)

    return _replace(module, swap)
