"""``SyncBatchNorm``: BatchNorm whose training statistics are the whole batch's, over ranks and DataParallel replicas,
and the conversion of a model's BatchNorm layers to it and back. Semantics: docs/syncbn.md.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from .._core.job import rank_world
from ..collectives.stall import InspectedTransport, group_transport
from ..collectives.timeouts import resolve_stall_timeout
from ..distributed.join import BACKWARD, FORWARD, JoinState
from .functions import BatchStats, Normalize, StatsPlan, SyncNormalize, pack_moments, stats_dtype, unpack_moments
from .group_sum import GroupSum, Rendezvous, ReplicaLink, check_channel, expect_in_join

__all__ = ["SyncBatchNorm", "revert_sync_batchnorm"]

_UNLINKED = "unlinked"  # a replica made by a DataParallel that does not link them (torch.nn.DataParallel)
_TORCH_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _sum_parts(vecs: list[torch.Tensor], outer: GroupSum | None, phase: int) -> torch.Tensor:
    """The replicas' vectors summed in replica order, then over the ranks when there are several."""
    total = vecs[0].clone()
    for v in vecs[1:]:
        total += v.to(total.device)
    return total if outer is None else outer(total, phase)


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.SyncBatchNorm``'s arguments, parameters and buffers; works on any device, any backend, inside
    ``fanfold.DataParallel`` and ``fanfold.DistributedDataParallel`` (``join()`` included), and alone."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None,
                 dtype: torch.dtype | None = None, *, bias: bool = True) -> None:
        # bias=False is passed only when asked for: torch versions before it existed take no such keyword
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         **({} if bias else {"bias": False}))
        self.process_group = process_group
        self.converted_from: type[nn.Module] | None = None  # set by convert_sync_batchnorm; used to revert
        self._join: JoinState | None = None
        self._replica: ReplicaLink | str | None = None
        self._transport: weakref.ref | None = None  # DDP's, when on this layer's group; DDP owns it

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of at least 2 dimensions (batch, channels, ...), "
                             f"got shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm(num_features={self.num_features}): the input has {input.shape[1]} "
                             f"channels (dimension 1 of shape {tuple(input.shape)})")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        track = self.training and self.track_running_stats
        factor = 0.0
        if track:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        if not self.training:  # the running statistics, or the batch's own when none are kept: no communication
            batch = self.running_mean is None and self.running_var is None
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, batch, 0.0,
                                self.eps)
        link = self._replica
        if link is _UNLINKED:
            raise RuntimeError(
                "SyncBatchNorm: this is a replica made by a DataParallel that does not link SyncBatchNorm's "
                "replicas (torch.nn.DataParallel, or replicate() and parallel_apply() by hand), so it would see its "
                "own slice of the batch only: use fanfold.DataParallel")
        outer = None
        # DDP's transport knows the group's size (torch.distributed's look-up costs a dozen Python calls a forward)
        transport = self._transport() if self._transport is not None else None
        if (transport.world_size if transport is not None else rank_world(self.process_group, from_env=False)[1]) > 1:
            if link is not None and self._join is not None:  # every rank alike: all have the same model
                raise RuntimeError(
                    "SyncBatchNorm: DataParallel replicas inside DistributedDataParallel.join() are not supported "
                    "(a rank that has joined would have to stand in for every replica's backward); use one "
                    "process per device under join()")
            outer = GroupSum(self._own_transport, self._join, self._name(), transport)
        if link is None and outer is None:  # nothing to synchronise with: plain BatchNorm
            return F.batch_norm(input, self.running_mean if track else None, self.running_var if track else None,
                                self.weight, self.bias, True, factor, self.eps)
        return self._synchronised(input, factor if track else None, link, outer)

    def _synchronised(self, x: torch.Tensor, factor: float | None, link: ReplicaLink | None,
                      outer: GroupSum | None) -> torch.Tensor:
        """Training with the whole batch's statistics; ``factor``: the running statistics' update, if kept."""
        vec = pack_moments(x)
        if link is not None and not link.concurrent_backward and torch.is_grad_enabled():
            return self._joined(x, vec, factor, link, outer)
        if link is None:  # ranks only
            moments = self._update(outer(vec, FORWARD), x, factor)
            reduce = functools.partial(outer, phase=BACKWARD)
        else:  # replicas (and ranks, if any), each running its own backward in its own thread
            rendezvous, i = link.rendezvous, link.index
            total = rendezvous.meet(i, vec, functools.partial(_sum_parts, outer=outer, phase=FORWARD), "forward")
            moments = self._update(total, x, factor)

            def reduce(packed: torch.Tensor) -> torch.Tensor:
                return rendezvous.meet(i, packed, functools.partial(_sum_parts, outer=outer, phase=BACKWARD),
                                       "backward").to(packed.device)
        return SyncNormalize.apply(x, moments.mean, moments.var, self.weight, self.bias,
                                   StatsPlan(moments, self.eps, reduce))

    def _joined(self, x: torch.Tensor, vec: torch.Tensor, factor: float | None, link: ReplicaLink,
                outer: GroupSum | None) -> torch.Tensor:
        """Replicas whose backward autograd's engine runs one after another: one statistics node for all."""
        identity = (lambda packed: packed) if outer is None else functools.partial(outer, phase=BACKWARD)

        def combine(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple | None]:
            # run once, by the last replica to arrive
            total = _sum_parts([v for v, _ in parts], outer, FORWARD)
            moments = unpack_moments(total, torch.float64)
            if moments.count == 1:
                return total, None  # each replica raises its own error
            return total, BatchStats.apply(StatsPlan(moments, self.eps, identity), *[p for _, p in parts])

        total, stats = link.rendezvous.meet(link.index, (vec, x), combine, "forward")
        moments = self._update(total, x, factor)
        i = link.index
        return Normalize.apply(x, stats[2 * i], stats[2 * i + 1], self.weight, self.bias,
                               StatsPlan(moments, self.eps, identity))

    def _update(self, total: torch.Tensor, x: torch.Tensor, factor: float | None):
        """The whole batch's moments from the parts' summed vectors; checks the count, moves the running statistics."""
        moments = unpack_moments(total.to(x.device), stats_dtype(x))
        if moments.count == 1:  # as plain BatchNorm, but counted over the whole batch
            raise ValueError(f"Expected more than 1 value per channel when training, got 1 over the whole batch "
                             f"(input size {tuple(x.shape)} here)")
        if factor is not None and moments.count > 0:
            # no no_grad context needed: the moments come from pack_moments' detached input, never from a graph
            mean, unbiased = moments.mean, moments.var * (moments.count / (moments.count - 1))
            if mean.dtype != self.running_mean.dtype:
                mean, unbiased = mean.to(self.running_mean.dtype), unbiased.to(self.running_mean.dtype)
            torch._foreach_lerp_((self.running_mean, self.running_var), (mean, unbiased), factor)  # one dispatch
        return moments

    def _name(self) -> str:
        return f"SyncBatchNorm({self.num_features})"

    def _replicate_for_data_parallel(self) -> SyncBatchNorm:
        replica = super()._replicate_for_data_parallel()
        replica._replica = _UNLINKED
        return replica

    def link_replicas(self, replicas: list[nn.Module], concurrent_backward: bool, name: str = "") -> None:
        """Called by fanfold.DataParallel before each forward with several replicas, on the original module."""
        label = f"SyncBatchNorm {name!r}" if name else self._name()
        rendezvous = Rendezvous(len(replicas), label, resolve_stall_timeout())
        for i, replica in enumerate(replicas):
            replica._replica = ReplicaLink(rendezvous, i, bool(concurrent_backward))

    def use_transport(self, transport: Any, process_group: Any) -> None:
        """Called by fanfold.DistributedDataParallel at construction: its collectives' transport and group."""
        world = dist.group.WORLD
        shared = (process_group or world) is (self.process_group or world)
        self._transport = weakref.ref(transport) if shared else None

    def _own_transport(self) -> InspectedTransport:
        # made at the first collective without DDP's, which every rank reaches alike, and kept by group_transport
        return group_transport(self.process_group, "SyncBatchNorm")

    def set_join_state(self, state: JoinState | None) -> None:
        """Called by DistributedDataParallel.join() on entry (the state) and on exit (None)."""
        if state is not None and rank_world(self.process_group, from_env=False)[1] > 1:
            check_channel(state, self.process_group, self._name())
            if self.training:
                p = self.running_mean if self.running_mean is not None else self.weight
                device = p.device if p is not None else torch.device("cpu")
                expect_in_join(state, self.num_features, device, self._own_transport())
        self._join = state

    def __getstate__(self) -> dict:
        # what belongs to one DDP, join() context or forward is not pickled (torch.save(model), copy.deepcopy)
        return {**super().__getstate__(), "_transport": None, "_join": None, "_replica": None}

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Replace every BatchNorm layer of ``module`` (torch's ``_BatchNorm`` subclasses: BatchNorm1d/2d/3d and
        torch's SyncBatchNorm) by a fanfold ``SyncBatchNorm`` sharing its parameters and buffers; returns the
        module (a new one when ``module`` itself is a BatchNorm). ``revert_sync_batchnorm`` undoes it."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"convert_sync_batchnorm: module must be an nn.Module, got {type(module).__name__}")

        def swap(m: nn.Module, name: str) -> nn.Module:
            if not isinstance(m, _BatchNorm) or isinstance(m, cls):
                return m
            new = _rebuild(m, cls, name, process_group=process_group)
            new.converted_from = next((c for c in _TORCH_CLASSES if isinstance(m, c)), None)
            return new

        return _replace(module, swap)


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every SyncBatchNorm of ``module`` (fanfold's or torch's) by a plain BatchNorm sharing its parameters
    and buffers: the torch class it was converted from, else one for any input dimension. For single-device
    inference and export; returns the module (a new one when ``module`` itself is a SyncBatchNorm)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"revert_sync_batchnorm: module must be an nn.Module, got {type(module).__name__}")

    def swap(m: nn.Module, name: str) -> nn.Module:
        if not isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm)):
            return m
        return _rebuild(m, getattr(m, "converted_from", None) or _BatchNormNd, name)

    return _replace(module, swap)


class _BatchNormNd(_BatchNorm):
    """Plain BatchNorm over inputs of any dimension >= 2 (what a reverted SyncBatchNorm of unknown origin becomes)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions, got shape {tuple(input.shape)}")


def _rebuild(old: _BatchNorm, cls: type, name: str, **extra: Any) -> _BatchNorm:
    """A ``cls`` layer with ``old``'s settings, holding ``old``'s very parameter and buffer objects (an optimizer
    made before keeps working, the state dict keys do not change)."""
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
