"""scatter / scatter_kwargs / gather over nested data, with torch's signatures, differentiable; a ``PackedSequence``
is split by sequences. Semantics: docs/data-parallel.md.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .._core.devices import DeviceLike, usable_device, usable_devices
from .._core.tree import first_difference, flatten, unflatten
from .functions import Gather, Scatter


def split_sizes(total: int, n: int, weights: Sequence[float] | None = None) -> list[int]:
    """How many of ``total`` rows each of up to ``n`` replicas gets (replicas that get nothing dropped): ``torch.chunk``
    sizes, or shares of ``weights`` rounded by largest remainder (ties to the lower index), every replica in use
    getting a row. An empty batch gives ``[0]``."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"split_sizes: total must be an int >= 0, got {total!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"split_sizes: n (the number of devices) must be an int >= 1, got {n!r}")
    if total == 0:
        return [0]
    if weights is None:
        size = math.ceil(total / n)
        return [size] * (total // size) + ([total % size] if total % size else [])
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"weights has {len(weights)} entries for {n} devices: give one weight per device")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"weights must be finite and > 0, got {weights} (to skip a device, leave it out)")
    quotas = [total * w / sum(weights) for w in weights]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    for i in range(min(total, n)):
        if sizes[i] == 0:
            # take from the largest share (the last one among equals, which is never a replica already served)
            donor = max(range(n), key=lambda j: (sizes[j], j))
            sizes[donor] -= 1
            sizes[i] = 1
    while sizes[-1] == 0:
        sizes.pop()
    return sizes


def _batch_size(path: str, leaf: Any, dim: int) -> int | None:
    """``leaf``'s size along ``dim`` (a PackedSequence's number of sequences); None if not scattered."""
    if isinstance(leaf, PackedSequence):
        return int(leaf.batch_sizes[0]) if len(leaf.batch_sizes) else 0
    if not isinstance(leaf, torch.Tensor):
        return None
    if not -leaf.dim() <= dim < leaf.dim():
        raise ValueError(f"scatter: dim {dim} is out of range for {path} with shape {tuple(leaf.shape)}" + (
            " (a 0-dim tensor cannot be split; pass a Python number to give it to every replica)"
            if leaf.dim() == 0 else ""))
    return leaf.size(dim)


def _plan(leaves: list, devices: list, dim: int, chunk_sizes, weights) -> list[int] | None:
    """The chunk sizes for this batch; None when nothing is scattered (then every device gets a replica)."""
    first = None
    for path, leaf in leaves:
        size = _batch_size(path, leaf, dim)
        if size is None:
            continue
        if first is None:
            first = (path, size)
        elif size != first[1]:
            raise ValueError(f"scatter: {path} has size {size} along dim {dim} but {first[0]} has {first[1]}; "
                             "every tensor being scattered must have the same batch size")
    if first is None:
        return None
    batch = first[1]
    if chunk_sizes is None:
        return split_sizes(batch, len(devices), weights)
    if weights is not None:
        raise ValueError("scatter: give chunk_sizes or weights, not both")
    sizes = list(chunk_sizes)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes):
        raise ValueError(f"scatter: chunk_sizes must be ints >= 0, got {sizes}")
    if not 1 <= len(sizes) <= len(devices):
        raise ValueError(f"scatter: {len(sizes)} chunk_sizes for {len(devices)} devices; give 1 to {len(devices)}")
    if sum(sizes) != batch:
        raise ValueError(f"scatter: chunk_sizes {sizes} sum to {sum(sizes)}, but the batch size is {batch} "
                         f"({first[0]} along dim {dim})")
    return sizes


def _scatter_packed(path: str, seq: PackedSequence, devices: list, sizes: list[int]) -> list[PackedSequence]:
    if 0 in sizes:
        raise ValueError(f"scatter: chunk_sizes {sizes} give a replica no sequence of {path}; "
                         "a PackedSequence cannot be empty")
    padded, lengths = pad_packed_sequence(seq)  # (time, batch, *), lengths in the caller's order
    chunks = Scatter.apply(devices, sizes, 1, padded)
    return [pack_padded_sequence(c, ls, enforce_sorted=False) for c, ls in zip(chunks, lengths.split(sizes))]


def _on(leaf: Any, device: torch.device) -> bool:
    leaf = leaf.data if isinstance(leaf, PackedSequence) else leaf
    return not isinstance(leaf, torch.Tensor) or leaf.device == device


def _split(leaves: list, target_gpus: Sequence[DeviceLike], dim: int, chunk_sizes, weights) -> list[list]:
    devices = usable_devices(target_gpus, "target_gpus")
    sizes = _plan(leaves, devices, dim, chunk_sizes, weights)
    n = len(devices) if sizes is None else len(sizes)
    if n == 1 and all(_on(leaf, devices[0]) for _, leaf in leaves):
        # one replica on the caller's device gets the caller's own tensors, exactly like the bare module
        return [[leaf for _, leaf in leaves]]
    per_leaf = []
    for path, leaf in leaves:
        if sizes is not None and isinstance(leaf, torch.Tensor):
            per_leaf.append(Scatter.apply(devices[:n], sizes, dim % leaf.dim(), leaf))
        elif sizes is not None and isinstance(leaf, PackedSequence):
            per_leaf.append(_scatter_packed(path, leaf, devices[:n], sizes))
        else:
            per_leaf.append([leaf] * n)
    return [[chunks[i] for chunks in per_leaf] for i in range(n)]


def _check_dim(dim: Any) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}: {dim!r}")


def scatter(
    inputs: Any,
    target_gpus: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    *,
    weights: Sequence[float] | None = None,
) -> list:
    """Split ``inputs`` (a tensor or nested structure) over ``target_gpus``; one structure per replica used."""
    _check_dim(dim)
    leaves, spec = flatten(inputs, "inputs")
    return [unflatten(spec, replica) for replica in _split(leaves, target_gpus, dim, chunk_sizes, weights)]


def scatter_kwargs(
    inputs: Any,
    kwargs: dict[str, Any] | None,
    target_gpus: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    *,
    weights: Sequence[float] | None = None,
) -> tuple[tuple[tuple, ...], tuple[dict[str, Any], ...]]:
    """Split positional ``inputs`` and ``kwargs`` with one plan: two tuples of the same length (replicas used)."""
    _check_dim(dim)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    in_leaves, in_spec = flatten(inputs, "inputs")
    kw_leaves, kw_spec = flatten(kwargs, "kwargs")
    cut = len(in_leaves)
    replicas = _split(in_leaves + kw_leaves, target_gpus, dim, chunk_sizes, weights)
    return (
        tuple(unflatten(in_spec, r[:cut]) for r in replicas),
        tuple(unflatten(kw_spec, r[cut:]) for r in replicas),
    )


def _gather_tensors(path: str, tensors: list[torch.Tensor], device: torch.device, dim: int) -> torch.Tensor:
    if all(t.dim() == 0 for t in tensors):
        warnings.warn(f"gather: every replica returned a 0-dim tensor at {path}; returning a vector with one value "
                      "per replica (reduce it, e.g. with .mean(), to get one value)",
                      stacklevel=4)  # _gather_tensors <- _gather_leaf <- gather <- caller
        tensors = [t.unsqueeze(0) for t in tensors]
        dim = 0
    ref = tensors[0]
    if not -ref.dim() <= dim < ref.dim():
        raise ValueError(f"gather: dim {dim} is out of range for {path} with shape {tuple(ref.shape)} (replica 0)")
    dim %= ref.dim()
    if len(tensors) == 1 and ref.device == device:
        return ref  # nothing to concatenate or move: the replica's own tensor, as the bare module would return it
    for i, t in enumerate(tensors[1:], 1):
        if t.dim() != ref.dim() or t.shape[:dim] + t.shape[dim + 1:] != ref.shape[:dim] + ref.shape[dim + 1:]:
            raise ValueError(f"gather: replica {i} returned shape {tuple(t.shape)} at {path}, replica 0 returned "
                             f"{tuple(ref.shape)}; they can only differ along dim {dim}")
    return Gather.apply(device, dim, *tensors)


def _gather_packed(seqs: list[PackedSequence], device: torch.device) -> PackedSequence:
    if len(seqs) == 1 and seqs[0].data.device == device:
        return seqs[0]
    unpacked = [pad_packed_sequence(s) for s in seqs]
    longest = max(p.size(0) for p, _ in unpacked)
    # pad every replica's (time, batch, *) block to the longest time so they concatenate along the batch
    padded = [torch.cat([p, p.new_zeros((longest - p.size(0), *p.shape[1:]))]) for p, _ in unpacked]
    lengths = torch.cat([ls for _, ls in unpacked])
    return pack_padded_sequence(Gather.apply(device, 1, *padded), lengths, enforce_sorted=False)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b) is True
    except Exception:  # e.g. arrays, whose == is elementwise
        return False


def _gather_leaf(path: str, values: list, device: torch.device, dim: int) -> Any:
    def kind(v):
        return "tensor" if isinstance(v, torch.Tensor) else "PackedSequence" if isinstance(v, PackedSequence) else None

    kinds = [kind(v) for v in values]
    for i, k in enumerate(kinds[1:], 1):
        if k != kinds[0]:
            raise ValueError(f"gather: replica {i} returned {k or type(values[i]).__name__} at {path}, replica 0 "
                             f"returned {kinds[0] or type(values[0]).__name__}")
    if kinds[0] == "tensor":
        return _gather_tensors(path, values, device, dim)
    if kinds[0] == "PackedSequence":
        return _gather_packed(values, device)
    for i, v in enumerate(values[1:], 1):
        if not _same_value(values[0], v):
            raise ValueError(f"gather: replicas returned different values at {path}: {values[0]!r} (replica 0) vs "
                             f"{v!r} (replica {i}); return tensors to have them concatenated")
    return values[0]


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate the replicas' ``outputs`` (same structure each) along ``dim`` on ``target_device`` (-1: the CPU)."""
    _check_dim(dim)
    if len(outputs) == 0:
        raise ValueError("gather: outputs is empty (no replica returned anything)")
    device = usable_device("cpu" if target_device == -1 else target_device, "target_device")
    flat = [flatten(out, "output") for out in outputs]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], 1):
        diff = first_difference(spec, other, "output")
        if diff is not None:
            raise ValueError(f"gather: replica {i} returned a different structure than replica 0 at {diff}")
    gathered = []
    for leaves in zip(*(leaves for leaves, _ in flat)):  # a plain loop keeps the warning's stacklevel exact
        gathered.append(_gather_leaf(leaves[0][0], [v for _, v in leaves], device, dim))
    return unflatten(spec, gathered)
