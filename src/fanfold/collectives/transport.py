"""``TorchTransport``: the collective interface (``protocol.Transport``) on a torch.distributed process group, each
method torch's collective (``reduce_tensors`` through one flat copy, as torch's DDP buckets and compression hooks)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed does not re-export it

from .._core.job import require_initialized
from .protocol import FanfoldWork, Transport, completed_work
from .timeouts import bound, group_timeout, resolve_stall_timeout

__all__ = ["TorchTransport", "reduce_through_copy", "scatter_through_copy", "split_into"]


def split_into(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (any shapes, a Parameter too), in order."""
    offset = 0
    with torch.no_grad():
        for out in outs:
            out.copy_(flat[offset: offset + out.numel()].view_as(out))
            offset += out.numel()


class TorchTransport:
    """The transport interface on a torch.distributed process group (``group=None``: the default group).
    ``native_scatter``: whether ``reduce_scatter`` and ``all_gather`` call torch's own (None: unless the group is
    gloo's, whose all-reduce was faster than its reduce-scatter; ZeRO stage 2 then broadcasts instead of gathering).
    ``timeout``: the stall timeout (``timeouts.resolve_stall_timeout``), bounding each collective inside torch's
    backend (its options' timeout)."""

    def __init__(self, group: Any = None, *, native_scatter: bool | None = None,
                 timeout: float | timedelta | None = None):
        require_initialized("TorchTransport")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.native_scatter = dist.get_backend(group) != "gloo" if native_scatter is None else bool(native_scatter)
        self._pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._device_types = {d.type for d in getattr(self._pg, "_device_types", [])}
        self._base, self._limit = resolve_stall_timeout(timeout), group_timeout(group)

    def _options(self, kind: type, **fields: Any) -> Any:
        # The bound of a collective issued now, in the options torch's backend reads per collective: gloo ends a
        # collective that runs out of time and closes its connections, so the peers' pending ones fail at once
        opts = kind()
        for name, value in fields.items():
            setattr(opts, name, value)
        opts.timeout = timedelta(seconds=bound(self._base, self._limit))
        return opts

    def _work(self, work: dist.Work, result: Any, finish: Callable[[], None] | None = None) -> FanfoldWork:
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce-scatter has no future: waited for here, bounded by its options
            work.wait()
            if finish is not None:
                finish()
            return completed_work(result)
        return FanfoldWork(future, result, finish)

    def _reduce(self, tensor: torch.Tensor, divisor: float | None, result: Any,
                then: Callable[[], None] | None = None) -> FanfoldWork:
        home = self._home(tensor)
        staged = tensor if home is None else tensor.to(home)
        work = self._pg.allreduce([staged], self._options(dist.AllreduceOptions, reduceOp=dist.ReduceOp.SUM))

        def finish() -> None:
            if divisor is not None:
                staged.div_(divisor)
            if staged is not tensor:
                tensor.copy_(staged)
            if then is not None:
                then()

        return self._work(work, result, finish)

    def _home(self, tensor: torch.Tensor) -> torch.device | None:
        """The device a copy of ``tensor`` must travel on, or None where the group takes it as it is: NCCL has no
        CPU backend, and fanfold's own small exchanges (the model fingerprint, join states) are CPU tensors."""
        if not self._device_types or tensor.device.type in self._device_types:
            return None
        kind = sorted(self._device_types)[0]
        return torch.device(kind, getattr(torch, kind).current_device())

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None
                   ) -> FanfoldWork:
        return self._reduce(tensor, divisor, tensor)

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> FanfoldWork:
        return reduce_through_copy(self, tensors, bucket, divisor, compress)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        # src is a rank of this group, as the group's own broadcast wants it
        home = self._home(tensor)
        staged = tensor if home is None else tensor.to(home)
        self._pg.broadcast([staged], self._options(dist.BroadcastOptions, rootRank=src, rootTensor=0)).wait()
        if staged is not tensor:
            tensor.copy_(staged)

    def barrier(self) -> None:
        self._pg.barrier(self._options(dist.BarrierOptions)).wait()

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None) -> FanfoldWork:
        n = out.numel()
        if not self.native_scatter:
            # gloo: its all-reduce was faster than its reduce-scatter here; this rank keeps its part of the sum
            return self._reduce(tensor, divisor, out, lambda: out.copy_(tensor[self.rank * n:(self.rank + 1) * n]))
        work = self._pg._reduce_scatter_base(out, tensor, self._options(dist.ReduceScatterOptions,
                                                                        reduceOp=dist.ReduceOp.SUM))
        return self._work(work, out, None if divisor is None else lambda: out.div_(divisor))

    def reduce_scatter_tensors(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, bucket: int | None = None,
                               *, divisor: float | None = None, settle: bool = True,
                               compress: torch.dtype | None = None) -> FanfoldWork:
        return scatter_through_copy(self, tensors, out, bucket, divisor, compress)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> FanfoldWork:
        home = self._home(out)
        got = out if home is None else torch.empty_like(out, device=home)
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        # in-place all-gathers are not promised
        send = tensor.to(home) if home is not None else tensor.clone() if lo <= tensor.data_ptr() < hi else tensor
        work = self._pg._allgather_base(got, send, self._options(AllgatherOptions))
        return self._work(work, out, None if got is out else lambda: out.copy_(got))

    def __repr__(self) -> str:
        return f"TorchTransport(rank={self.rank}, world_size={self.world_size}, backend={dist.get_backend(self.group)})"


def reduce_through_copy(transport: Transport, tensors: Sequence[torch.Tensor], bucket: int | None,
                        divisor: float | None, compress: torch.dtype | None) -> FanfoldWork:
    """``reduce_tensors`` through one flat copy: ``transport.all_reduce`` of it, the division, the copy back.
    ``compress``: torch's compression hook on that copy (cast, divide, all-reduce, copy back)."""
    if compress not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"reduce_tensors: compress must be None, torch.bfloat16 or torch.float16, got {compress}")
    tensors = list(tensors)
    if not tensors:
        return completed_work(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if compress is not None:
        flat = flat.to(compress)
        if divisor is not None:
            flat.div_(divisor)
        divisor = None
    # all_reduce without divisor: a subclass that only records the call sees it as a plain all-reduce
    work = transport.all_reduce(flat, bucket)

    def finish() -> None:
        if divisor is not None:
            flat.div_(divisor)
        split_into(flat, tensors)

    return FanfoldWork(work.get_future(), tensors, finish)


def scatter_through_copy(transport: Transport, tensors: Sequence[torch.Tensor], out: torch.Tensor,
                         bucket: int | None, divisor: float | None, compress: torch.dtype | None) -> FanfoldWork:
    """``reduce_scatter_tensors`` through one zero-padded flat copy: ``transport.reduce_scatter`` of it, this rank's
    part into ``out``. ``compress``: cast, divide, reduce, cast back, as ``reduce_through_copy``."""
    if compress not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"reduce_scatter_tensors: compress must be None, torch.bfloat16 or torch.float16, got "
                         f"{compress}")
    tensors = list(tensors)
    total, n = sum(t.numel() for t in tensors), transport.world_size
    part = -(-total // n)
    if out.numel() != part or not out.is_contiguous() or any(t.dtype != out.dtype for t in tensors):
        raise ValueError(f"reduce_scatter_tensors: out must be a contiguous {out.dtype} tensor of ceil({total} / {n}) "
                         f"= {part} elements, as the tensors' dtype; got {tuple(out.shape)} for tensors of "
                         f"{sorted({str(t.dtype) for t in tensors})}")
    stage = torch.zeros(part * n, dtype=compress or out.dtype, device=out.device)
    offset = 0
    for t in tensors:
        stage[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    if compress is not None and divisor is not None:
        stage.div_(divisor)
        divisor = None
    narrow = out if compress is None else torch.empty(part, dtype=compress, device=out.device)
    work = transport.reduce_scatter(stage, narrow, bucket, divisor=divisor)
    return work if narrow is out else FanfoldWork(work.get_future(), out, lambda: out.copy_(narrow))
