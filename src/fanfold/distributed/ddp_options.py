"""torch's ``DistributedDataParallel`` keywords, checked (an error naming a bad one; torch's deprecation warnings)
and turned into fanfold's settings, one dataclass. The keyword-by-keyword table: docs/ddp-compat.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .._core.devices import normalize_device

__all__ = ["DDPOptions", "resolve_options", "bucket_caps", "MiB", "check_devices", "sparse_flags",
           "no_trainable_parameters", "check_join"]


@dataclass
class DDPOptions:
    """What DistributedDataParallel does, from torch's keywords (and fanfold's own)."""

    process_group: Any
    forward_sync_buffers: bool  # broadcast buffers from rank 0 before every training forward (torch's default)
    init_sync_buffers: bool  # buffers in the broadcast at construction (off only for broadcast_buffers=False)
    caps: list[int]  # bucket caps in bytes: the k-th bucket of a dtype takes caps[k], the last one after
    find_unused: bool
    as_view: bool  # torch's gradient_as_bucket_view (with mixed_precision .grad is a full-precision copy, as in torch)
    static_graph: bool
    skip_unused: bool
    delayed: list[str] = field(default_factory=list)  # names of delay_all_reduce_named_params


MiB = 1024 * 1024


def _mib(name: str, value: Any, shown: Any) -> int:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number of MiB, got {shown!r}")
    return max(1, int(value * MiB))


def bucket_caps(bucket_cap_mb: float | None = None, first_bucket_cap_mb: float | None = None,
                bucket_cap_mb_list: Sequence[float] | None = None) -> list[int]:
    """Bucket caps in bytes: the k-th bucket of a dtype takes ``caps[k]``, the last one after. torch's
    ``bucket_cap_mb_list`` gives them all; else a small first bucket (1 MiB, never above the rest), then 25 MiB."""
    if bucket_cap_mb_list is not None:
        if first_bucket_cap_mb is not None:
            raise ValueError("DistributedDataParallel: first_bucket_cap_mb and bucket_cap_mb_list both set the first "
                             "bucket's cap; give one")
        if isinstance(bucket_cap_mb_list, (str, bytes)) or not isinstance(bucket_cap_mb_list, Sequence) or \
                not bucket_cap_mb_list:
            raise ValueError(f"bucket_cap_mb_list must be a non-empty list of MiB figures, got {bucket_cap_mb_list!r}")
        return [_mib("each of bucket_cap_mb_list", mb, bucket_cap_mb_list) for mb in bucket_cap_mb_list]
    cap = _mib("bucket_cap_mb", 25.0 if bucket_cap_mb is None else bucket_cap_mb, bucket_cap_mb)
    first = _mib("first_bucket_cap_mb", 1.0 if first_bucket_cap_mb is None else first_bucket_cap_mb,
                 first_bucket_cap_mb)
    return [min(first, cap), cap]


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"DistributedDataParallel: {name} must be True or False, got {value!r}")
    return value


def _process_group(process_group: Any, device_mesh: Any) -> Any:
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("DistributedDataParallel: Cannot specify both process_group and device_mesh arguments.")
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {device_mesh!r}")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"DistributedDataParallel: Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        raise NotImplementedError(
            "DistributedDataParallel: device_mesh sliced out of a larger mesh (data parallel combined with tensor "
            "parallel, DTensor parameters) is not supported by fanfold; pass a 1-D mesh of the data-parallel ranks")
    return device_mesh.get_group(mesh_dim=0)


def _delayed(module: nn.Module, named: Any, hook_param: Any) -> list[str]:
    if (named is None) != (hook_param is None):
        raise ValueError("DistributedDataParallel: delay_all_reduce_named_params and param_to_hook_all_reduce need "
                         "to be set at the same time.")
    if named is None:
        return []
    params = dict(module.named_parameters())
    names = []
    for entry in named:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and params.get(entry[0]) is entry[1]):
            raise ValueError(f"delay_all_reduce_named_params must hold (name, parameter) pairs of the module, as "
                             f"module.named_parameters() gives them; got {entry!r}")
        names.append(entry[0])
    if not any(hook_param is p for p in params.values()):
        raise ValueError(f"param_to_hook_all_reduce must be a parameter of the module, got a tensor of shape "
                         f"{tuple(getattr(hook_param, 'shape', ()))}")
    return names


def resolve_options(
    module: nn.Module, *, process_group: Any, device_mesh: Any, broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None, bucket_cap_mb: float | None, first_bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None, find_unused_parameters: bool, check_reduction: bool,
    gradient_as_bucket_view: bool, static_graph: bool, delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any, skip_all_reduce_unused_params: bool, batched_grad_copy: bool,
    mixed_precision: Any,
) -> DDPOptions:
    """Check torch's keywords; raise (TypeError/ValueError/RuntimeError/NotImplementedError) naming a bad one."""
    group = _process_group(process_group, device_mesh)
    if broadcast_buffers is not None:
        _flag("broadcast_buffers", broadcast_buffers)
        warnings.warn("DistributedDataParallel: `broadcast_buffers` is deprecated (torch 2.13); use "
                      "`forward_sync_buffers`. Unlike broadcast_buffers=False, forward_sync_buffers=False still syncs "
                      "buffers at construction." + (" `forward_sync_buffers` takes precedence over it, as in torch."
                                                    if forward_sync_buffers is not None else ""),
                      FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        forward, init = _flag("forward_sync_buffers", forward_sync_buffers), True
    else:
        forward = init = True if broadcast_buffers is None else broadcast_buffers
    if _flag("check_reduction", check_reduction):
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please "
                      "avoid using it. (It has no effect in torch either: the reducer always completes the "
                      "reduction.)", FutureWarning, stacklevel=3)
    caps = bucket_caps(bucket_cap_mb, first_bucket_cap_mb, bucket_cap_mb_list)
    static = _flag("static_graph", static_graph)
    find_unused = _flag("find_unused_parameters", find_unused_parameters)
    if static and find_unused:
        warnings.warn("DistributedDataParallel: find_unused_parameters=True is not needed with static_graph=True, "
                      "which finds the unused parameters in the first iteration (they must stay unused).",
                      stacklevel=3)
    as_view = _flag("gradient_as_bucket_view", gradient_as_bucket_view)
    _flag("batched_grad_copy", batched_grad_copy)  # what fanfold always does: a bucket's copies together
    return DDPOptions(
        process_group=group, forward_sync_buffers=forward, init_sync_buffers=init, caps=caps,
        find_unused=find_unused, as_view=as_view, static_graph=static,
        skip_unused=_flag("skip_all_reduce_unused_params", skip_all_reduce_unused_params),
        delayed=_delayed(module, delay_all_reduce_named_params, param_to_hook_all_reduce),
    )


def check_devices(module: nn.Module, device_ids: list | None, output_device: Any) -> tuple:
    """(device_ids, output_device): None for both, or this process's one device where every parameter is."""
    if device_ids is None:
        return None, None
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise ValueError(f"device_ids must be None or one device (this process's), got {device_ids!r}: "
                         "DistributedDataParallel runs one process per device")
    dev = normalize_device(device_ids[0])
    wrong = [n for n, p in module.named_parameters() if normalize_device(p.device) != dev]
    if wrong:
        raise ValueError(f"device_ids={device_ids!r} but parameter {wrong[0]!r} is on another device: move the "
                         f"module to {dev} before wrapping it")
    return [dev], normalize_device(output_device) if output_device is not None else dev


def sparse_flags(module: nn.Module, names: Sequence[str]) -> list[bool]:
    """For each named parameter, whether it gets sparse gradients: the weight of an nn.Embedding or
    nn.EmbeddingBag built with sparse=True (the modules torch's DDP treats as sparse)."""
    sparse = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            sparse.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False))
    return [n in sparse for n in names]


def no_trainable_parameters(module: nn.Module, delayed: Sequence[str]) -> bool:
    """torch refuses such a module: nothing to average (delayed parameters count as something)."""
    return not any(p.requires_grad for n, p in module.named_parameters() if n not in delayed) and not delayed


def check_join(nested: bool, skip_unused: bool, sharded: bool) -> None:
    """Refuse what ``DistributedDataParallel.join()`` cannot do, naming it."""
    if nested:
        raise RuntimeError("DistributedDataParallel.join() contexts cannot be nested")
    if skip_unused:
        raise NotImplementedError("DistributedDataParallel.join() with skip_all_reduce_unused_params=True: a rank "
                                  "that has joined cannot tell which buckets the others skip")
    if sharded:
        raise NotImplementedError("DistributedDataParallel.join() with shard_gradients(): a joined rank would "
                                  "have to step its part of the optimizer too")
