"""``SyncBatchNorm``: BatchNorm whose training statistics are the whole batch's, over ranks and DataParallel replicas,
and the conversion of a model's BatchNorm layers to it and back. Each part's moments travel as one packed vector
``[n*mean | n*(var + mean^2) | n]``; replicas (threads of one process) meet at a ``Rendezvous``, ranks in one
all-reduce per forward and per backward (``GroupSum``). Formulas and numerics: docs/syncbn.md.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from .._core.job import rank_world
from ..collectives.stall import InspectedTransport, group_transport
from ..collectives.timeouts import resolve_stall_timeout
from ..distributed.join import BACKWARD, FORWARD, JoinState

__all__ = ["SyncBatchNorm", "revert_sync_batchnorm"]

_UNLINKED = "unlinked"  # a replica made by a DataParallel that does not link them (torch.nn.DataParallel)
_TORCH_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_EMPTY = object()


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def wide_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def pack_moments(x: torch.Tensor) -> torch.Tensor:
    """This part's packed vector (float64, on ``x``'s device); all zeros for an empty part."""
    # detached: a graph here would join the replicas' graphs behind the Functions' backs
    x = x.detach()
    c = x.shape[1]
    n = x.numel() // c if c else 0
    wide = wide_dtype(x.device)
    if n == 0:
        return torch.zeros(2 * c + 1, dtype=wide, device=x.device)
    # mean and biased variance per channel by the corrected two-pass algorithm, exact in any memory format (torch's
    # statistics kernel is not on channels-last CPU inputs)
    data = x if x.dtype == stats_dtype(x) else x.to(stats_dtype(x))
    guess = data.sum([0, *range(2, data.dim())]).div_(n)  # a float32 sum: off by its own rounding when |mean| >> std
    d = data - guess.view([1, c] + [1] * (data.dim() - 2))
    # sum(d^2) and sum(d) in one pass: the BatchNorm-backward kernel's sum(dy * (x - mean) * invstd) and sum(dy) with
    # dy = x = d, mean 0, invstd 1 (var 0, eps 1)
    zeros, ones, saved = guess.new_zeros(c), guess.new_ones(c), guess.new_empty(0)
    _, s2, s1 = torch.ops.aten.native_batch_norm_backward(d, d, ones, zeros, zeros, saved, saved, False, 1.0,
                                                          [False, True, True])
    g, s1, s2 = torch.stack([guess, s1, s2]).to(wide).unbind()
    mean, var = g + s1 / n, (s2 - s1.square() / n) / n  # the guess corrected by the mean deviation
    return torch.cat((mean, torch.addcmul(var, mean, mean), mean.new_ones(1))).mul_(n)


@dataclass
class Moments:
    """The whole batch's per-channel ``count`` (batch x spatial), ``mean`` and biased ``var``."""

    count: int
    mean: torch.Tensor
    var: torch.Tensor


def unpack_moments(total: torch.Tensor, dtype: torch.dtype) -> Moments:
    c = (total.numel() - 1) // 2
    count = int(total[2 * c])
    if count == 0:
        zeros = total.new_zeros(c, dtype=dtype)
        return Moments(0, zeros, zeros)
    both = total / count  # [E[x] | E[x^2] | 1] in float64, then E[x^2] - E[x]^2 in place
    mean, var, _ = both.split_with_sizes((c, c, 1))
    var.addcmul_(mean, mean, value=-1).clamp_(min=0)
    if dtype != both.dtype:
        mean, var, _ = both.to(dtype).split_with_sizes((c, c, 1))
    return Moments(count, mean, var)


def _part_sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(dy * xhat), sum(dy))`` over this part, by torch's kernel."""
    if x.numel() == 0:  # the kernel divides by the element count: an empty part contributes nothing
        zeros = var.new_zeros(var.shape)
        return zeros, zeros
    # evaluation mode on the given statistics. CUDA's kernel wants every optional tensor defined (on an H100 it failed
    # on None): the saved statistics are empty (it then takes the given ones), a missing weight is ones
    saved = mean.new_empty(0)
    _, gw, gb = torch.ops.aten.native_batch_norm_backward(dy, x, torch.ones_like(var) if weight is None else weight,
                                                          mean, var, saved, saved, False, eps, [False, True, True])
    return gw, gb


class SyncNormalize(Function):
    """``SyncNormalize.apply(moments, reduce, eps, *xs, *weights, *biases) -> ys``: BatchNorm of each part on the
    whole batch's ``moments``. Backward: the parts' ``[sum(dy) | sum(dy * xhat)]``, summed and passed to ``reduce``
    (the backward's one collective, made before the weights' and biases' gradients reach autograd and DDP's hooks),
    give each part its ``dx``; each part keeps its own share of its weight's and bias's gradients."""

    @staticmethod
    def forward(ctx: Any, moments: Moments, reduce: Callable, eps: float, *args: torch.Tensor | None) -> tuple:
        n = len(args) // 3
        xs, weights, biases = args[:n], args[n:2 * n], args[2 * n:]
        means = [moments.mean.to(x.device, stats_dtype(x)) for x in xs]
        variances = [moments.var.to(x.device, stats_dtype(x)) for x in xs]
        ctx.eps, ctx.count, ctx.reduce = eps, moments.count, reduce
        ctx.save_for_backward(*xs, *weights, *means, *variances)
        return tuple(F.batch_norm(*p, False, 0.0, eps) for p in zip(xs, means, variances, weights, biases))

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        n = len(dys)
        xs, weights, means, variances = (ctx.saved_tensors[i * n:(i + 1) * n] for i in range(4))
        need = ctx.needs_input_grad[3:]
        sums = [_part_sums(*p, ctx.eps) for p in zip(dys, xs, means, variances, weights)]
        dxs: list[torch.Tensor | None] = [None] * n
        if any(need[:n]):
            home = means[0].device
            packed = [torch.cat((gb, gw)).to(home, wide_dtype(home)) for gw, gb in sums]
            total = ctx.reduce(functools.reduce(torch.Tensor.add_, packed))
            dxs = [None if not need[i] else torch.zeros_like(xs[i]) if xs[i].numel() == 0 else
                   _whole_batch_dx(dys[i], xs[i], means[i], variances[i], weights[i], total, ctx) for i in range(n)]
        # weight and bias exist together, or the bias alone is absent (bias=False): both take the weight's dtype
        gws = [gw.to(w.dtype) if need[n + i] else None for i, ((gw, _), w) in enumerate(zip(sums, weights))]
        gbs = [gb.to(w.dtype) if need[2 * n + i] else None for i, ((_, gb), w) in enumerate(zip(sums, weights))]
        return None, None, None, *dxs, *gws, *gbs


def _whole_batch_dx(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                    weight: torch.Tensor | None, total: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``dx = a * dy + (x - mean) * k1 + k0`` per channel, with ``a = w * invstd``, ``k0 = -a * sum(dy) / M`` and
    ``k1 = -a * invstd * sum(dy * xhat) / M`` from ``total`` = ``[sum(dy) | sum(dy * xhat)]`` over the whole batch."""
    invstd = torch.rsqrt(var + ctx.eps)
    a = invstd if weight is None else invstd * weight
    coef = torch.cat((a, a * invstd)).div_(-ctx.count)
    k0, k1 = total.to(x.device, coef.dtype).mul_(coef).view((2, -1) + (1,) * (x.dim() - 2)).unbind(0)
    # in place after x - mean (not x * k1 - mean * k1, which cancels when |mean| >> std); not addcmul(k0, x - mean,
    # k1): its broadcast first operand takes a slow kernel on CPU (5x one in-place pass)
    dx = (x - mean.view(k0.shape)).mul_(k1).addcmul_(dy, a.view(k0.shape)).add_(k0)
    return dx if dx.dtype == x.dtype else dx.to(x.dtype)


def _zeros_all_reduce(numel: int, dtype: torch.dtype, device: torch.device, transport: InspectedTransport) -> None:
    transport.all_reduce_now(torch.zeros(numel, dtype=dtype, device=device))


@dataclass
class GroupSum:
    """Sums one layer's packed vectors over the ranks: through ``shared`` (DDP's transport on the layer's group, if
    any) outside ``join``, else through ``own()`` (the layer's own transport, made at first use)."""

    own: Any
    join: JoinState | None
    name: str
    shared: InspectedTransport | None = None

    def __call__(self, vec: torch.Tensor, phase: int) -> torch.Tensor:
        join = self.join
        if join is not None and phase == BACKWARD and not join.begin_backward():
            # a backward DDP does not synchronise (no_sync()): a rank that has joined would never hear of it
            if join.alive < join.transport.world_size:
                raise RuntimeError(
                    f"{self.name}: a backward under no_sync() inside DistributedDataParallel.join() while rank(s) "
                    f"{sorted(set(range(join.transport.world_size)) - set(join.last_active))} have run out of "
                    "inputs: they cannot take part in SyncBatchNorm's backward. Synchronise every backward inside "
                    "join(), or accumulate gradients outside it.")
            join = None  # all ranks are here; nothing to record (a shadow replays synchronised backwards only)
        transport = self.shared if self.shared is not None and self.join is None else self.own()
        transport.all_reduce_now(vec)
        if join is not None:
            join.record(phase, functools.partial(_zeros_all_reduce, vec.numel(), vec.dtype, vec.device, transport))
        return vec


class Rendezvous:
    """A barrier with one slot per replica, one meeting after another: the last to arrive combines the payloads in
    replica order (every replica sees the same bits); a replica that never comes, within ``timeout`` seconds, makes
    the others raise naming it, after which the rendezvous stays broken."""

    def __init__(self, parties: int, name: str, timeout: float):
        self.parties, self.name, self.timeout = parties, name, timeout
        self._slots: list[Any] = [_EMPTY] * parties
        self._barrier = threading.Barrier(parties, self._combine)
        self._lock = threading.Lock()
        self._combiner: Callable[[list[Any]], Any] | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    def meet(self, index: int, payload: Any, combine: Callable[[list[Any]], Any], what: str) -> Any:
        """Deposit ``payload`` as replica ``index``; once all have, ``combine(payloads)`` runs once (in the last
        replica's thread) and every replica returns its result. ``what`` names the meeting in errors."""
        self._slots[index], self._combiner = payload, combine
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            with self._lock:
                if self._error is None:  # a timeout: the first replica to see it names the missing ones
                    missing = [i for i, s in enumerate(self._slots) if s is _EMPTY]
                    self._error = RuntimeError(
                        f"{self.name}: replica(s) {missing} of {self.parties} did not reach the {what} within "
                        f"{self.timeout:g} s (replica {index} waited). A replica that raised earlier, a backward that "
                        "reached only some replicas, or replicas run one after another instead of concurrently "
                        "(fanfold.DataParallel runs them concurrently); the timeout is $FANFOLD_STALL_TIMEOUT")
                    raise self._error from None
            raise RuntimeError(f"{self.name}: the replicas cannot meet at the {what}: a meeting failed "
                               f"({type(self._error).__name__}: {self._error})") from self._error
        # the result stays until all have read it: the next meeting cannot complete without them
        return self._result

    def _combine(self) -> None:
        payloads, self._slots = self._slots, [_EMPTY] * self.parties
        try:
            self._result = self._combiner(payloads)
        except BaseException as exc:
            self._error = exc
            raise


@dataclass(frozen=True)
class ReplicaLink:
    """What one replica of a SyncBatchNorm knows about its siblings for one forward (and its backward)."""

    rendezvous: Rendezvous
    index: int
    concurrent_backward: bool  # True: each replica runs its backward in its own thread (parallel_backward)


def _sum_parts(vecs: list[torch.Tensor], outer: GroupSum | None, phase: int) -> torch.Tensor:
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
        # torch before 2.13 has no ``bias`` keyword (its layers always carry one): passed only when it says no bias
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,
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
        part = (x, self.weight, self.bias)
        ys = None
        if link is None:  # ranks only
            total = outer(vec, FORWARD)
            reduce = functools.partial(outer, phase=BACKWARD)
        else:
            # autograd's engine may run the replicas' backward one after another on one thread, where a replica's node
            # would wait for replicas not run yet: then one node normalises every replica, joining their graphs
            serial = not link.concurrent_backward and torch.is_grad_enabled()
            backward = functools.partial(_sum_parts, outer=outer, phase=BACKWARD)

            def combine(payloads: list[tuple[torch.Tensor, tuple]]) -> tuple[torch.Tensor, tuple | None]:
                total = _sum_parts([v for v, _ in payloads], outer, FORWARD)
                if not serial or int(total[-1]) == 1:  # a count of 1: each replica raises its own error
                    return total, None
                xs, weights, biases = zip(*[p for _, p in payloads])
                return total, SyncNormalize.apply(unpack_moments(total, torch.float64), lambda vec: backward([vec]),
                                                  self.eps, *xs, *weights, *biases)

            total, ys = link.rendezvous.meet(link.index, (vec, part), combine, "forward")

            def reduce(packed: torch.Tensor) -> torch.Tensor:
                return link.rendezvous.meet(link.index, packed, backward, "backward").to(packed.device)
        moments = self._update(total, x, factor)
        if ys is not None:
            return ys[link.index]
        return SyncNormalize.apply(moments, reduce, self.eps, *part)[0]

    def _update(self, total: torch.Tensor, x: torch.Tensor, factor: float | None) -> Moments:
        """The whole batch's moments from the parts' summed vectors; checks the count, moves the running statistics."""
        moments = unpack_moments(total.to(x.device), stats_dtype(x))
        if moments.count == 1:  # as plain BatchNorm, but counted over the whole batch
            raise ValueError(f"Expected more than 1 value per channel when training, got 1 over the whole batch "
                             f"(input size {tuple(x.shape)} here)")
        if factor is not None and moments.count > 0:
            # the moments come from pack_moments' detached input, never from a graph: no no_grad context needed
            mean, unbiased = moments.mean, moments.var * (moments.count / (moments.count - 1))
            if mean.dtype != self.running_mean.dtype:
                mean, unbiased = mean.to(self.running_mean.dtype), unbiased.to(self.running_mean.dtype)
            torch._foreach_lerp_((self.running_mean, self.running_var), (mean, unbiased), factor)
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
            if state.transport.on_group(self.process_group):  # the shm transport, or a user's, is a channel apart
                raise RuntimeError(
                    f"{self._name()}: DistributedDataParallel.join() cannot shadow SyncBatchNorm when DDP's "
                    "collectives and SyncBatchNorm's share one process group (transport='torch' on the same group): a "
                    "rank that has joined could not reproduce how the two interleave in backward. Give SyncBatchNorm "
                    "a group of its own (convert_sync_batchnorm(model, process_group=torch.distributed.new_group()), "
                    "on every rank), or use the shared-memory transport (transport='shm') where every rank shares a "
                    "host.")
            if self.training:
                # what a rank that joins before its first step replays: the forward's collective (2C+1 numbers) and
                # the backward's (2C)
                p = self.running_mean if self.running_mean is not None else self.weight
                device = p.device if p is not None else torch.device("cpu")
                zeros = functools.partial(_zeros_all_reduce, dtype=wide_dtype(device), device=device,
                                          transport=self._own_transport())
                state.expect(functools.partial(zeros, 2 * self.num_features + 1),
                             functools.partial(zeros, 2 * self.num_features))
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
    new = cls(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats, device="meta",
              **({} if old.bias is not None or not old.affine else {"bias": False}), **extra)
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
