"""``TorchTransport``: the collective interface (``protocol.Transport``) on a torch.distributed process group, each
method torch's collective (``reduce_tensors`` through one flat copy, as torch's DDP buckets; ``compress`` as torch's
compression hooks), and the small exchanges of structured data built from ``all_reduce`` alone
(:func:`all_gather_rows`: float32 rows only their owner fills, integers below 2**24, exact on every transport).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed does not re-export it

from .._core.job import require_initialized
from .protocol import Transport
from .timeouts import bound, group_timeout, resolve_stall_timeout
from .work import completed_work

__all__ = ["TorchTransport", "DividedWork", "reduce_through_copy", "split_into", "all_gather_rows", "all_gather_bytes"]


class DividedWork(dist._Work):
    """A torch ``Work`` whose ``wait()`` also runs ``finish()`` (once): the division or copy-back that follows a sum.
    A torch Work itself, so that the stall inspector bounds its wait as gloo's (a timed wait ends the collective);
    it needs no future from ``handle`` (gloo's reduce-scatter has none)."""

    def __init__(self, handle: Any, finish: Callable[[], None]):
        super().__init__()
        self._handle, self._finish = handle, finish

    def wait(self, timeout: timedelta | None = None) -> Any:
        result = self._handle.wait() if timeout is None else self._handle.wait(timeout)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return result

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def get_future(self) -> torch.futures.Future:
        """The sum's future (before ``finish``)."""
        return self._handle.get_future()


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
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._pg = pg
        self._device_types = {d.type for d in getattr(pg, "_device_types", [])}
        self._base, self._limit = resolve_stall_timeout(timeout), group_timeout(group)

    def _options(self, kind: type, **fields: Any) -> Any:
        # The bound of a collective issued now, in the options torch's backend reads per collective: gloo ends a
        # collective that runs out of time and closes its connections, so the peers' pending ones fail at once
        opts = kind()
        for name, value in fields.items():
            setattr(opts, name, value)
        opts.timeout = timedelta(seconds=bound(self._base, self._limit))
        return opts

    def _sum(self, tensor: torch.Tensor) -> dist.Work:
        return self._pg.allreduce([tensor], self._options(dist.AllreduceOptions, reduceOp=dist.ReduceOp.SUM))

    def _home(self, tensor: torch.Tensor) -> torch.device | None:
        """The device a copy of ``tensor`` must travel on, or None where the group takes it as it is: NCCL has no
        CPU backend, and fanfold's own small exchanges (the model fingerprint, join states) are CPU tensors."""
        if not self._device_types or tensor.device.type in self._device_types:
            return None
        kind = sorted(self._device_types)[0]
        return torch.device(kind, getattr(torch, kind).current_device())

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> Any:
        home = self._home(tensor)
        if home is not None:
            staged = tensor.to(home)
            work = self._sum(staged)
            return DividedWork(work, lambda: tensor.copy_(staged if divisor is None else staged.div_(divisor)))
        work = self._sum(tensor)
        return work if divisor is None else DividedWork(work, lambda: tensor.div_(divisor))

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> dist.Work:
        """``tensors`` all-reduced in place through one flat copy (``settle``: nothing to settle, the copy is
        private). ``compress``: torch's compression hook on that copy -- cast, divide, all-reduce, copy back."""
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
                       divisor: float | None = None) -> Any:
        n = out.numel()
        if not self.native_scatter:
            # gloo: its all-reduce was faster than its reduce-scatter here; this rank keeps its part of the sum
            return self.all_reduce(tensor, bucket, divisor) if self.world_size == 1 else DividedWork(
                self.all_reduce(tensor, bucket, divisor), lambda: out.copy_(tensor[self.rank * n:(self.rank + 1) * n]))
        work = self._pg._reduce_scatter_base(out, tensor, self._options(dist.ReduceScatterOptions,
                                                                        reduceOp=dist.ReduceOp.SUM))
        return work if divisor is None else DividedWork(work, lambda: out.div_(divisor))

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> Any:
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        send = tensor.clone() if lo <= tensor.data_ptr() < hi else tensor  # in-place all-gathers are not promised
        return self._pg._allgather_base(out, send, self._options(AllgatherOptions))

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"TorchTransport(rank={self.rank}, world_size={self.world_size}, backend={dist.get_backend(self.group)})"


def reduce_through_copy(transport: Transport, tensors: Sequence[torch.Tensor], bucket: int | None,
                        divisor: float | None, compress: torch.dtype | None) -> dist.Work:
    """``reduce_tensors`` for a transport that has no way of its own to reduce tensors where they lie: one flat copy,
    ``transport.all_reduce`` of it, the division, the copy back. ``compress``: torch's compression hook on that copy
    (cast, divide, all-reduce, copy back)."""
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

    return DividedWork(work, finish)


def all_gather_rows(transport: Transport, row: torch.Tensor) -> torch.Tensor:
    """Every rank's float32 ``row`` (same length everywhere), stacked by rank: one all-reduce of a zero matrix
    whose row ``rank`` this rank fills. Values must be integers below 2**24 for the sum to be exact."""
    table = torch.zeros(transport.world_size, row.numel(), dtype=torch.float32, device=row.device)
    table[transport.rank] = row.to(torch.float32)
    transport.all_reduce(table).wait()
    return table


def all_gather_bytes(transport: Transport, data: bytes, device: torch.device | str = "cpu") -> list[bytes]:
    """Every rank's ``data`` by rank, in two fixed-shape all-reduces (lengths, then the padded bytes)."""
    lengths = all_gather_rows(transport, torch.tensor([float(len(data))], device=device))[:, 0].long().tolist()
    if max(lengths) == 0:
        return [b""] * len(lengths)
    row = torch.zeros(max(lengths), dtype=torch.float32, device=device)
    if data:
        row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.float32)
    table = all_gather_rows(transport, row).to(torch.uint8).cpu()
    return [bytes(table[r, :n].tolist()) for r, n in enumerate(lengths)]
