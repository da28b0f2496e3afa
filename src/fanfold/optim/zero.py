"""``ZeroRedundancyOptimizer``: any torch optimizer, its state sharded over the ranks of a process group (ZeRO-1;
stage 2 with ``DistributedDataParallel.shard_gradients``). Each rank steps 1-D views of its equal slice of the flat
parameters (``layout``), then the slices are all-gathered. ``clip_grad_norm_`` over such sharded gradients: every
p-norm combines from per-rank partial sums, one collective of a scalar."""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from .._core.job import rank_world
from ..collectives.objects import all_gather_object, gather_object
from ..collectives.stall import group_transport
from ..distributed.reducer import Reducer
from .layout import PieceState, assemble, cut, pieces_of, plan_spaces
from .sharded_grads import GradientShards, check_shards

__all__ = ["ZeroRedundancyOptimizer", "clip_grad_norm_"]

# Elements received per all-gather round after a step (all ranks' parts together): the step's extra memory.
GATHER_ELEMENTS = 1 << 22
# torch optimizers whose update of one element depends on other elements of the same parameter: a slice would not
# step as the whole parameter does. Every other class is taken at its word, as torch's ZeroRedundancyOptimizer does.
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


def _numbered(param_groups: list[dict]) -> list[dict]:
    """torch's ``state_dict`` form of parameter groups: the options, and the parameters as running indices."""
    ends = itertools.accumulate(len(g["params"]) for g in param_groups)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(end - len(g["params"]), end))}
            for g, end in zip(param_groups, ends)]


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class(params, **defaults)`` so that each rank of ``process_group`` keeps and steps only its
    ``1/N`` slice of the flat parameters, then all-gathers the updated parameters.

    Every rank constructs it with the same parameters (checked: shapes, dtypes and groups) and calls ``step``,
    ``consolidate_state_dict`` and ``add_param_group`` together (they are collectives). Gradients are used as they
    are: average them over the ranks first (DistributedDataParallel does). Without an initialised process group it
    runs as one rank. ``state_dict()`` returns what ``optimizer_class`` over the same parameters would, after
    ``consolidate_state_dict(to=this rank)``; ``load_state_dict`` takes such a state (from any world size, or from a
    plain torch optimizer) and keeps this rank's slice.
    """

    def __init__(self, params: Iterable, optimizer_class: type, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer subclass "
                            f"(e.g. torch.optim.Adam), got {optimizer_class!r}")
        bad = [n for n in NOT_ELEMENTWISE if getattr(torch.optim, n, None) is optimizer_class]
        if bad:
            raise ValueError(f"ZeroRedundancyOptimizer: {bad[0]} does not update each element independently, so "
                             f"it cannot step slices of parameters")
        if parameters_as_bucket_view:
            raise ValueError("ZeroRedundancyOptimizer: parameters_as_bucket_view=True is not supported; fanfold "
                             "writes the gathered slices straight into the parameters already")
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True is not supported by fanfold")
        self._ready = False
        self.process_group = process_group
        self.rank, self.world_size = rank_world(process_group, from_env=False)
        self.optimizer_class = optimizer_class
        self._user_defaults = dict(defaults)
        self._consolidated, self._consolidated_to = None, None  # the state gathered by consolidate_state_dict
        self._stage2: GradientShards | None = None  # the reducer's strategy, once gradient_strategy ran (stage 2)
        super().__init__(params, defaults)
        self._check_same_params()
        self._build()
        self.defaults = dict(self.optim.defaults)
        self._ready = True

    def _check_same_params(self) -> None:
        if self.world_size == 1:
            return
        mine = [(g, tuple(p.shape), str(p.dtype)) for g, group in enumerate(self.param_groups) for p in group["params"]]
        every = all_gather_object(mine, group=self.process_group)
        for r, theirs in enumerate(every):
            pairs = list(itertools.zip_longest(theirs, every[0], fillvalue="nothing"))
            diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            if diff is not None:
                raise ValueError(f"ZeroRedundancyOptimizer: rank {r}'s parameters differ from rank 0's ({len(theirs)} "
                                 f"vs {len(every[0])} parameters; parameter {diff} as (group, shape, dtype): "
                                 f"{pairs[diff][0]} on rank {r}, {pairs[diff][1]} on rank 0); every rank must pass the "
                                 f"same parameters")

    def _build(self) -> None:
        """This rank's pieces and a fresh inner optimizer over 1-D views of them, group for group."""
        self._params = [p for g in self.param_groups for p in g["params"]]
        groups = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        for i, p in enumerate(self._params):
            if not p.is_contiguous():
                raise ValueError(f"ZeroRedundancyOptimizer: parameter {i} (shape {tuple(p.shape)}) is not contiguous; "
                                 f"its slices cannot be viewed in place")
        self._spaces = plan_spaces(self._params, self.world_size)
        # stage 2: the slices are this rank's parts of the buckets, each bucket a space of optimizer indices
        spaces = self._spaces if self._stage2 is None else \
            [replace(s, indices=tuple(self._opt_index[i] for i in s.indices)) for s in self._stage2.layout]
        pieces = pieces_of(spaces, groups, self.rank)
        # inner group g steps this rank's pieces of group g (maybe none: the group stays, as on the other ranks)
        self._pieces = [pc for g in range(len(self.param_groups)) for pc in pieces if pc.group == g]
        self._views = [self._params[pc.index].detach().view(-1)[pc.start:pc.stop] for pc in self._pieces]
        self.optim = self.optimizer_class([{**{k: v for k, v in g.items() if k != "params"},
                                            "params": [v for pc, v in zip(self._pieces, self._views) if pc.group == gi]}
                                           for gi, g in enumerate(self.param_groups)], **self._user_defaults)
        for g, ig in zip(self.param_groups, self.optim.param_groups):
            for k, v in ig.items():
                g.setdefault(k, v)

    def _sync_hyper(self) -> None:  # schedulers and users change self.param_groups: the inner optimizer follows
        for g, ig in zip(self.param_groups, self.optim.param_groups):
            ig.update({k: v for k, v in g.items() if k != "params"})

    def _shard_grads(self) -> list[torch.Tensor]:
        """Point each piece's view's ``.grad`` at its slice of the gradient; the views that got one."""
        for pc, v in zip(self._pieces, self._views):
            p = self._params[pc.index]
            if self._stage2 is not None:  # the reducer's parts of the averaged gradients
                v.grad = self._stage2.grad(self._ddp_index[pc.index], pc.space, pc.offset, pc.numel)
            elif p.grad is None:
                v.grad = None
            elif p.grad.is_sparse:
                raise RuntimeError(f"ZeroRedundancyOptimizer: parameter {pc.index} has a sparse gradient")
            else:
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                v.grad = p.grad.view(-1)[pc.start:pc.stop]
        return [v for v in self._views if v.grad is not None]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's slice with the inner optimizer, then all-gather the parameters (collective)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyper()
        self._shard_grads()
        try:
            self.optim.step()
        finally:
            for v in self._views:  # a view would keep the whole gradient alive after zero_grad
                v.grad = None
        self._gather_params() if self._stage2 is None else self._stage2.gather_params()
        self._consolidated = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with sharded gradients it also clears this rank's parts (until then they
        accumulate over synchronised backward passes, as ``.grad`` would)."""
        super().zero_grad(set_to_none)
        if self._stage2 is not None:
            self._stage2.zero_grad(set_to_none)

    def gradient_strategy(self, reducer: Reducer) -> GradientShards:
        """Stage 2, for ``DistributedDataParallel.shard_gradients(self)`` on every rank (collective): the slices become
        this rank's parts of ``reducer``'s buckets, the state moves to match; the reducer's strategy."""
        shards = GradientShards(reducer)
        self._opt_index = check_shards(shards, self._params, self.rank, self.world_size)
        full = self._full_state()
        shards.lay_flat()  # the parameters become views of DDP's buckets: the views below must be taken after
        self._stage2 = shards
        self._ddp_index = {k: i for i, k in enumerate(self._opt_index)}
        self._build()
        self._load_full(full)
        return shards

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank's updated slice to every rank, in rounds of at most ``GATHER_ELEMENTS`` received elements."""
        if self.world_size == 1:
            return
        n = self.world_size
        flat = [p.detach().view(-1) for p in self._params]
        for space in self._spaces:
            width = max(1, min(space.shard, -(-GATHER_ELEMENTS // n)))
            send = torch.empty(width, dtype=space.dtype, device=space.device)
            out = torch.empty(width * n, dtype=space.dtype, device=space.device)
            for lo in range(0, space.shard, width):
                w = min(width, space.shard - lo)
                mine = self.rank * space.shard + lo
                if mine + w > space.total:
                    send.zero_()  # the last slices are padded to equal size
                for i, a, b, at in space.spans(mine, mine + w):
                    send[at:at + b - a].copy_(flat[i][a:b])
                group_transport(self.process_group, "ZeroRedundancyOptimizer").all_gather(send[:w], out[:w * n]).wait()
                for q in range(n):
                    if q == self.rank:
                        continue  # stepped in place already
                    base = q * space.shard + lo
                    for i, a, b, at in space.spans(base, base + w):
                        flat[i][a:b].copy_(out[q * w + at:q * w + at + b - a])

    def _full_state(self, to: int | None = None) -> dict[int, dict] | None:
        """Every rank's pieces of the state assembled on every rank (``to`` None) or on rank ``to`` (else None)."""
        every: list | None = [[PieceState(pc.index, pc.start, pc.stop, dict(self.optim.state.get(v, {})))
                               for pc, v in zip(self._pieces, self._views)]]
        if self.world_size > 1:
            every = all_gather_object(every[0], group=self.process_group) if to is None else \
                gather_object(every[0], dst=to, group=self.process_group)
        return assemble([r for rs in every for r in rs], self._params) if to in (None, self.rank) else None

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's slice of the state on rank ``to`` of the group (collective: call it on every rank)."""
        if not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict: to={to!r} is not a rank of the group (0..{self.world_size - 1})")
        self._consolidated, self._consolidated_to = self._full_state(to), to

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in torch's format, as ``optimizer_class`` over the same parameters returns it.
        Needs ``consolidate_state_dict(to=<this rank>)`` on every rank since the last ``step``."""
        if self._consolidated is None:
            where = ("" if self._consolidated_to in (None, self.rank) else
                     f" (it was last consolidated to rank {self._consolidated_to}, not this one)")
            raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: the state is sharded; call "
                               f"consolidate_state_dict(to={self.rank}) on every rank first, after the last step()"
                               f"{where}")
        return {"state": {i: dict(s) for i, s in self._consolidated.items()},
                "param_groups": _numbered(self.param_groups)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a whole state in torch's format (from ``state_dict()`` at any world size or a plain torch optimizer
        over the same parameters); this rank keeps its slice. Not a collective."""
        if not (isinstance(state_dict, Mapping) and "state" in state_dict
                and isinstance(state_dict.get("param_groups"), list)):
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict: expected a dict with 'state' and "
                             f"'param_groups', got {type(state_dict).__name__}")
        saved = state_dict["param_groups"]
        want, got = [len(g["params"]) for g in self.param_groups], [len(g["params"]) for g in saved]
        if want != got:
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: parameter groups of sizes {got} in the state, "
                             f"{want} in this optimizer")
        index = {pid: k for k, pid in enumerate(pid for g in saved for pid in g["params"])}
        unknown = [pid for pid in state_dict["state"] if pid not in index]
        if unknown:
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: state for unknown parameter ids {unknown[:5]}")
        for g, sg in zip(self.param_groups, saved):
            g.update({k: v for k, v in sg.items() if k != "params"})
        self._load_full({index[pid]: s for pid, s in state_dict["state"].items()})

    def _load_full(self, full: Mapping[int, dict]) -> None:
        self._sync_hyper()
        state = {k: cut(full[pc.index], pc, self._params[pc.index]) for k, pc in enumerate(self._pieces)
                 if pc.index in full}
        self.optim.load_state_dict({"state": state, "param_groups": _numbered(self.optim.param_groups)})
        self._consolidated = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; the flat layout changes, so the state is re-sharded (collective: call it on every rank)."""
        if not self._ready:  # torch.optim.Optimizer.__init__ adds the constructor's groups through here
            super().add_param_group(param_group)
            return
        if self._stage2 is not None:
            raise RuntimeError("ZeroRedundancyOptimizer.add_param_group: not possible once gradients are sharded "
                               "(DistributedDataParallel.shard_gradients): the slices follow DDP's buckets")
        full = self._full_state()
        super().add_param_group(param_group)
        self._check_same_params()
        self._build()
        self._load_full(full)


def _partial(norms: list[torch.Tensor], p: float) -> torch.Tensor:
    if not norms:
        return torch.full((), math.inf if p == -math.inf else 0.0, dtype=torch.float64)
    every = torch.stack(norms)
    return every.max() if p == math.inf else every.min() if p == -math.inf else (every ** p).sum()


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, process_group: Any = None) -> torch.Tensor:
    """Clip gradients to a total ``norm_type``-norm of at most ``max_norm``; return the total norm (before clipping).

    ``parameters`` is what ``torch.nn.utils.clip_grad_norm_`` takes (and then this *is* torch's function), or a
    :class:`ZeroRedundancyOptimizer`: the norm is then taken over the whole model from each rank's slice of the
    (averaged) gradients, and only this rank's slice is scaled, which is all its step reads. With ``process_group``
    the given tensors' gradients are this rank's disjoint shard of the model's. Sharded calls are collectives.
    """
    if isinstance(parameters, ZeroRedundancyOptimizer):  # its 1-D views, each holding its slice's gradient
        held, group, world = parameters._shard_grads(), parameters.process_group, parameters.world_size
    elif process_group is not None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        held, group = [p for p in params if p.grad is not None], process_group
        world = dist.get_world_size(group)
    else:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    p = float(norm_type)
    if p == 0:
        raise ValueError("clip_grad_norm_: norm_type=0 is not supported over sharded gradients (torch's 0-norm counts "
                         "whole tensors with a non-zero gradient, which a rank holding slices cannot count)")
    # Per-rank partial sums travel in float64 so that every rank sends the same dtype whatever its shard holds.
    grads = [t.grad for t in held]
    norms = [torch.linalg.vector_norm(g, p).to(torch.float64).cpu() for g in grads]
    total = _partial(norms, p)
    if world > 1:
        transport = group_transport(group, "clip_grad_norm_")
        total = total.to(grads[0].device if grads else total.device).reshape(1)
        if p in (math.inf, -math.inf):  # the transport sums: the extreme of every rank's partial, gathered
            every = total.new_empty(world)
            transport.all_gather(total, every).wait()
            total = every.max() if p == math.inf else every.min()
        else:
            transport.all_reduce(total).wait()
            total = total[0]
    if p not in (math.inf, -math.inf):
        total = total ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total.item()} "
                           f"(non-finite); pass error_if_nonfinite=False to clip anyway")
    torch.nn.utils.clip_grads_with_norm_(held, max_norm, total, foreach)
    return total.to(grads[0].dtype) if grads else total
