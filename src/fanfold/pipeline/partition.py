"""How a pipeline cuts its work: a sequential model into stages (a checked ``balance``, or one evening out parameter
counts or measured time), and a batch into micro-batches along dim 0, with their loss weights."""
from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._core.tree import flatten
from ..parallel.scatter_gather import gather, scatter
from .skip import Pop, Stash
from .stage import buffers_kept, map_tensors, tensor_leaves

__all__ = ["layers_of", "resolve_balance", "balance_by_parameters", "balance_by_time", "stage_modules", "batch_size",
           "split", "join", "loss_weights"]


def layers_of(module: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(module, nn.Sequential):
        layers = list(module.named_children())
    elif isinstance(module, (list, tuple, nn.ModuleList)):
        for i, layer in enumerate(module):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"module[{i}] is a {type(layer).__name__}, not an nn.Module: a pipeline's layers "
                                "must be modules")
        layers = [(str(i), layer) for i, layer in enumerate(module)]
    elif isinstance(module, nn.Module):
        raise TypeError(
            f"Pipeline needs a sequential model (nn.Sequential or a list of modules), got {type(module).__name__}: "
            "its forward() could do anything with its children, so it cannot be cut into stages. Write it as "
            "nn.Sequential(layer1, layer2, ...) (a layer may return a tuple of tensors for the next one)")
    else:
        raise TypeError(f"module must be an nn.Sequential or a list of modules, got {type(module).__name__}")
    if not layers:
        raise ValueError("module has no layers: nothing to pipeline")
    return layers


def resolve_balance(balance: Any, layers: list[tuple[str, nn.Module]], stages: int,
                    sample_input: Any = None) -> list[int]:
    n = len(layers)
    if stages > n:
        raise ValueError(f"{stages} stages but the model has only {n} layers: every stage needs at least one layer")
    if balance == "auto":
        return balance_by_parameters([m for _, m in layers], stages)
    if balance == "profile":
        if sample_input is None:
            raise ValueError('balance="profile" times each layer on a sample batch: pass sample_input=<a batch>')
        skips = [path for name, layer in layers for path, m in layer.named_modules(prefix=name)
                 if isinstance(m, (Stash, Pop))]
        if skips:
            raise ValueError(f'balance="profile" times each layer alone, which a skip connection ({skips[0]}) '
                             'cannot do: give balance as a list or "auto"')
        return balance_by_time([m for _, m in layers], sample_input, stages)
    if isinstance(balance, str) or not isinstance(balance, Sequence):
        raise TypeError(f'balance must be "auto", "profile" or a list of layer counts, got {balance!r}')
    balance = list(balance)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in balance):
        raise ValueError(f"balance must hold ints >= 1 (layers per stage), got {balance}")
    if len(balance) != stages:
        raise ValueError(f"balance {balance} has {len(balance)} stages but devices has {stages}: give one device per "
                         "stage")
    if sum(balance) != n:
        raise ValueError(f"balance {balance} sums to {sum(balance)} but the model has {n} layers "
                         f"({', '.join(name for name, _ in layers[:8])}{', ...' if n > 8 else ''})")
    return balance


def _partition(costs: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of ``costs`` into ``parts`` non-empty runs minimising (largest run cost, largest run length),
    by dynamic programming."""
    n, prefix = len(costs), [0.0, *itertools.accumulate(costs)]
    # best[p][i]: (the best key splitting the first i layers into p runs, where its last run starts); ties: the
    # earliest start
    best = [[((math.inf, n + 1), 0)] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = ((0.0, 0), 0)
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            best[p][i] = min(((max(best[p - 1][j][0][0], prefix[i] - prefix[j]), max(best[p - 1][j][0][1], i - j)), j)
                             for j in range(p - 1, i))
    sizes, i = [], n
    for p in range(parts, 0, -1):
        j = best[p][i][1]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def balance_by_parameters(layers: Sequence[nn.Module], stages: int) -> list[int]:
    """Layer counts per stage that even out the number of parameters (and buffers) per stage."""
    costs = [sum(t.numel() for t in (*m.parameters(), *m.buffers())) for m in layers]
    return _partition(costs, stages)


def _detached(obj: Any) -> Any:
    # not a leaf: a first layer working in place is allowed, as in the model
    return map_tensors(obj, lambda t: t.detach().requires_grad_().clone() if t.is_floating_point() else t.detach())


def balance_by_time(layers: Sequence[nn.Module], sample_input: Any, stages: int, repeat: int = 3) -> list[int]:
    """Layer counts per stage that even out the forward + backward time of ``sample_input`` (each layer on its device,
    the median of ``repeat`` runs after a warm-up). ``.grad`` and the buffers are restored after."""
    saved = [(p, p.grad) for m in layers for p in m.parameters()]
    costs: list[float] = []
    x = sample_input
    try:
        with buffers_kept(nn.ModuleList(layers)):
            for layer in layers:
                times = []
                for _ in range(repeat + 1):
                    inp = _detached(x)
                    start = time.perf_counter()
                    out = layer(inp)
                    outs = [t for t in tensor_leaves(out) if t.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                    for device in {t.device for t in tensor_leaves(out) if t.device.type != "cpu"}:
                        torch.accelerator.synchronize(device)
                    times.append(time.perf_counter() - start)
                costs.append(sorted(times[1:])[len(times[1:]) // 2])
                x = _detached(out)
    finally:
        for p, g in saved:
            p.grad = g
    return _partition(costs, stages)


def stage_modules(layers: list[tuple[str, nn.Module]], balance: list[int]) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per stage over the same layer objects, each layer under its original name."""
    ends = list(itertools.accumulate(balance))
    return [nn.Sequential(OrderedDict(layers[end - count:end])) for count, end in zip(balance, ends)]


def _tensor_leaves(obj: Any, path: str) -> list[tuple[Any, torch.Tensor]]:
    return [(p, x) for p, x in flatten(obj, path)[0] if isinstance(x, torch.Tensor)]


def batch_size(obj: Any, name: str) -> int:
    leaves = _tensor_leaves(obj, name)
    if not leaves:
        raise ValueError(f"{name} holds no tensor: a pipeline splits its batch along dim 0 into micro-batches")
    first_path, first = leaves[0]
    for path, t in leaves:
        if t.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor: it has no batch dimension to split into micro-batches")
        if t.size(0) != first.size(0):
            raise ValueError(f"{path} has {t.size(0)} rows along dim 0 but {first_path} has {first.size(0)}: every "
                             "tensor of a batch must have the same batch size")
    return first.size(0)


def split(obj: Any, sizes: list[int], device: torch.device) -> list[Any]:
    return scatter(obj, [device] * len(sizes), 0, sizes)


def join(outputs: list[Any], device: torch.device) -> Any:
    for path, t in _tensor_leaves(outputs[0], "output"):
        if t.dim() == 0:
            raise ValueError(f"the last stage returned a 0-dim tensor at {path}: a pipeline's output must keep the "
                             "batch dimension so the micro-batches can be re-joined (reduce it after the pipeline)")
    return gather(outputs, device, 0)


def loss_weights(sizes: list[int], reduction: str) -> list[float]:
    """Each micro-batch's loss factor, so that their sum is the whole batch's loss."""
    if reduction == "sum":
        return [1.0] * len(sizes)
    if reduction == "mean":
        total = sum(sizes)
        return [s / total if total else 1.0 for s in sizes]
    raise ValueError(f'reduction must be "mean" or "sum" (how loss_fn reduces over the batch), got {reduction!r}')
