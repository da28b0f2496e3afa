"""parallel_apply_backward: CPU replicas' forward and backward run concurrently by the worker pool, under one autograd
Function (``_Replicas``); a double backward re-runs their forward on the caller's thread. docs/data-parallel.md.
"""
from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Function
from torch.nn.utils.rnn import PackedSequence

from .._core.tree import flatten, unflatten
from .parallel_apply import WorkerPool, _call, _caller_state, _run


def _tensor(leaf: Any) -> torch.Tensor | None:
    if isinstance(leaf, PackedSequence):
        return leaf.data
    return leaf if isinstance(leaf, torch.Tensor) else None


def _with_tensor(leaf: Any, tensor: torch.Tensor) -> Any:
    if isinstance(leaf, PackedSequence):
        return PackedSequence(tensor, leaf.batch_sizes, leaf.sorted_indices, leaf.unsorted_indices)
    return tensor


def _leaves_of(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen, leaves = set(), []
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


def _alias_parameters(replicas: Sequence[nn.Module]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list]:
    """Give each replica its own leaf sharing the memory of every parameter that requires grad (so that hooks on a
    parameter run once, on the summed gradient): the parameters, per replica its leaves, and what was swapped."""
    params: dict[int, torch.Tensor] = {}
    for r in replicas:
        for p in r.parameters():
            if p.requires_grad:
                params.setdefault(id(p), p)
    per_replica, restore = [], []
    for r in replicas:
        alias = {k: p.detach().requires_grad_(True) for k, p in params.items()}
        restore.append([])
        for m in r.modules():
            for key, p in list(m._parameters.items()):
                if p is not None and id(p) in alias:
                    # a replica's own dict (_replicate_for_data_parallel); setattr, so that nn.LSTM sees the leaf
                    del m._parameters[key]
                    setattr(m, key, alias[id(p)])
                    restore[-1].append((m, key, p))
        per_replica.append(list(alias.values()))
    return list(params.values()), per_replica, restore


def _recompute_backward(plan: dict, outs: Sequence[torch.Tensor], grads: Sequence) -> list:
    """The Function's gradients as a differentiable graph (double backward): each replica's forward run again on the
    caller's thread, its buffers left as they were, its outputs checked against the first forward's."""
    warnings.warn("DataParallel: double backward (create_graph=True) through CPU replicas: their forward is run "
                  "again on the caller's thread to build a differentiable graph (slower; parallel_backward=False "
                  "avoids the recomputation)", stacklevel=3)
    recomputed = []
    for i, (module, args, kwargs, device) in enumerate(zip(plan["modules"], plan["inputs"], plan["kwargs"],
                                                            plan["devices"])):
        for m, key, p in plan["restore"][i]:
            setattr(m, key, p)
        # into copies of the buffers (the first forward updated them), swapped back: its graph may save them
        kept = [(m, key, b) for m in module.modules() for key, b in m._buffers.items() if b is not None]
        for m, key, b in kept:
            m._buffers[key] = b.clone()
        try:
            out = _call(module, args, kwargs, device, plan["state"])
        finally:
            for m, key, b in kept:
                m._buffers[key] = b
        leaves, _ = flatten(out, "output")
        recomputed.extend(t for t in (_tensor(v) for _, v in leaves) if t is not None)
    for i, (start, stop) in enumerate(plan["output_slices"]):
        for a, b in zip(outs[start:stop], recomputed[start:stop]):
            if a.shape != b.shape or not torch.allclose(a.detach(), b.detach(), rtol=1e-4, atol=1e-5, equal_nan=True):
                raise RuntimeError(
                    f"DataParallel: double backward (create_graph=True) runs replica {i}'s forward again, and its "
                    "outputs changed (a random op such as dropout?); create the model with "
                    "DataParallel(..., parallel_backward=False) to keep the first forward's graph")
    pairs = [(o, g) for o, g in zip(recomputed, grads) if g is not None and o.requires_grad]
    targets = list(plan["originals"]) + list(plan["shared_tensors"])
    if not pairs:
        return [None] * len(targets)
    return list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], create_graph=True,
                                    allow_unused=True))


class _Replicas(Function):
    @staticmethod
    def forward(ctx, plan: dict, *tensors: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.plan = plan
        outs = plan.pop("outputs")  # computed before apply (see parallel_apply_backward): the replicas' graphs
        ctx.save_for_backward(*outs)
        result = tuple(o.detach() for o in outs)
        ctx.mark_non_differentiable(*[r for r, o in zip(result, outs) if not o.requires_grad])
        return result

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        plan = ctx.plan
        outs = ctx.saved_tensors  # raises autograd's own error on a second backward without retain_graph
        if torch.is_grad_enabled():  # create_graph=True: the replicas' graphs start at detached leaves
            return (None, *_recompute_backward(plan, outs, grads))
        n = len(plan["devices"])
        fns = []
        for i in range(n):
            lo, hi = plan["output_slices"][i]
            pairs = [(o, g) for o, g in zip(outs[lo:hi], grads[lo:hi]) if g is not None and o.requires_grad]
            targets = plan["leaves"][i]

            def work(pairs=pairs, targets=targets):
                if not pairs or not targets:
                    return [None] * len(targets)
                return list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                                retain_graph=True, allow_unused=True))
            fns.append(work)
        per_replica = _run(plan["pool"], fns, plan["devices"])

        # replica 0's gradient of a shared tensor becomes the sum if nothing else holds its memory: autograd may
        # pass an incoming gradient through unchanged, or give two leaves the same tensor
        foreign = {g.untyped_storage().data_ptr() for g in grads if g is not None and g.layout == torch.strided}
        counts = Counter(g.untyped_storage().data_ptr() for g in per_replica[0]
                         if g is not None and g.layout == torch.strided)

        def owned(g: torch.Tensor) -> bool:
            # dense and contiguous over its whole storage (a weight's gradient comes back as a .t().t() view of
            # its own); sparse gradients (nn.Embedding(sparse=True)) are summed out of place
            if g.layout != torch.strided:
                return False
            storage = g.untyped_storage()
            return (g.is_contiguous() and storage.nbytes() == g.numel() * g.element_size()
                    and storage.data_ptr() not in foreign and counts[storage.data_ptr()] == 1)

        # leaves[i][k] for k < len(shared_tensors): replica i's stand-in for shared_tensors[k] (a parameter, ...)
        shared_tensors = plan["shared_tensors"]
        sums: list = [None] * len(shared_tensors)
        order = sorted(range(len(shared_tensors)), key=lambda k: -shared_tensors[k].numel())

        def add(group: list[int]) -> None:
            for k in group:
                gs = [per_replica[i][k] for i in range(n) if per_replica[i][k] is not None]
                if gs:
                    mine = per_replica[0][k] is not None and owned(gs[0])
                    sums[k] = functools.reduce(torch.Tensor.add_, gs[1:], gs[0] if mine else gs[0].clone())

        # the biggest tensors first, spread over the workers
        _run(plan["pool"], [functools.partial(add, order[w::n]) for w in range(n)], plan["devices"])

        result = [None] * len(plan["originals"]) + sums
        for i in range(n):
            for index, position in plan["own"][i]:
                result[position] = per_replica[i][index]
        return (None, *result)


def parallel_apply_backward(
    modules: Sequence[nn.Module],
    inputs: Sequence[tuple],
    kwargs_tup: Sequence[dict],
    devices: Sequence[torch.device],
    pool: WorkerPool,
) -> list[Any]:
    """``parallel_apply`` (arguments normalised) whose replicas' backward the workers run too: CPU replicas sharing
    their parameters (``replicate`` onto the module's own device)."""
    devices = list(devices)
    n = len(modules)
    params, aliases, restore = _alias_parameters(modules)
    state = _caller_state(devices, grad=True)
    # every replica's tensor arguments, detached: leaves of that replica's own graph
    arg_leaves, spec = flatten((list(inputs), list(kwargs_tup)))
    originals: list[torch.Tensor] = []
    detached_leaves = []
    own_by_id: dict[int, int] = {}
    for _, leaf in arg_leaves:
        t = _tensor(leaf)
        if t is not None and t.requires_grad:
            d = t.detach().requires_grad_(True)
            own_by_id[id(d)] = len(originals)
            originals.append(t)
            detached_leaves.append(_with_tensor(leaf, d))
        else:
            detached_leaves.append(leaf)
    ins, kws = unflatten(spec, detached_leaves)

    def replica(module: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> Any:
        # the replica gets a clone of each detached leaf, so that it may modify its arguments in place (as the bare
        # module may a non-leaf input; autograd forbids that on a leaf); made here, by the worker, concurrently
        with torch.enable_grad():
            leaves, s = flatten((args, kwargs))
            args, kwargs = unflatten(s, [_with_tensor(v, _tensor(v).clone()) if id(_tensor(v)) in own_by_id else v
                                         for _, v in leaves])
        return _call(module, args, kwargs, device, state)

    fns = [lambda m=m, a=a, k=k, d=d: replica(m, a, k, d) for m, a, k, d in zip(modules, ins, kws, devices)]
    outputs = _run(pool, fns, devices)

    flat_outputs, out_specs, out_leaves, slices = [], [], [], []
    for out in outputs:
        leaves, s = flatten(out, "output")
        out_specs.append(s)
        out_leaves.append(leaves)
        lo = len(flat_outputs)
        flat_outputs.extend(t for t in (_tensor(v) for _, v in leaves) if t is not None)
        slices.append((lo, len(flat_outputs)))

    # the Function's inputs: every argument that requires grad, the parameters, then every other leaf the graphs
    # reach; what each replica differentiates: its arguments and its aliases of the parameters
    shared_tensors: list[torch.Tensor] = list(params)
    shared_index = {id(p): k for k, p in enumerate(shared_tensors)}
    own_lists: list[list[torch.Tensor]] = [[] for _ in range(n)]
    alias_ids = {id(a) for replica_aliases in aliases for a in replica_aliases}
    for i in range(n):
        lo, hi = slices[i]
        for leaf in _leaves_of(flat_outputs[lo:hi]):
            if id(leaf) in own_by_id:
                own_lists[i].append(leaf)
            elif id(leaf) not in alias_ids and id(leaf) not in shared_index:
                shared_index[id(leaf)] = len(shared_tensors)
                shared_tensors.append(leaf)
    plan = {
        "devices": devices, "pool": pool, "outputs": flat_outputs, "output_slices": slices,
        "leaves": [a + shared_tensors[len(params):] + mine for a, mine in zip(aliases, own_lists)],
        "shared_tensors": shared_tensors, "originals": originals,
        # own[i]: (index among replica i's leaves, position among the originals) of each argument it differentiates
        "own": [[(len(shared_tensors) + j, own_by_id[id(t)]) for j, t in enumerate(mine)] for mine in own_lists],
        # to run the replicas again for a double backward (_recompute_backward)
        "modules": list(modules), "inputs": list(inputs), "kwargs": list(kwargs_tup), "state": state,
        "restore": restore,
    }
    results = _Replicas.apply(plan, *originals, *shared_tensors)
    it = iter(results)
    rebuilt = []
    for leaves, s in zip(out_leaves, out_specs):
        rebuilt.append(unflatten(s, [v if _tensor(v) is None else _with_tensor(v, next(it)) for _, v in leaves]))
    return rebuilt
