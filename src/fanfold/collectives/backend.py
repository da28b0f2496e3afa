"""The ``fanfold`` torch.distributed backend: ``init_process_group("fanfold")`` runs torch's collectives (and so
torch's DDP, ZeroRedundancyOptimizer and FSDP2), in every calling form of torch's ``ProcessGroup`` methods, on the
group's transport (``select.choose``) where the tensors allow it, on an inner gloo backend otherwise. Every path
depends only on what is the same on every rank (op, dtype, device, number of tensors). docs/backend.md.
"""
from __future__ import annotations

import inspect
import os
import platform
import threading
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    _create_work_from_future,
)

from .._core.eager import eager
from .creator import refuse_unwrapped
from .hierarchical import HierarchicalTransport
from .protocol import FanfoldWork, StallError, Transport, completed_work, failed_work
from .select import ENV_VAR, choose, host_views
from .shm.engine import DTYPES, GLOO, REFUSED, Claim, Op, ShmMismatchError, reduce_code
from .shm.transport import SegmentSpaceError, ShmTransport
from .timeouts import DEFAULT_STALL_TIMEOUT, StoreGroup, bound, resolve_stall_timeout
from .timeouts import ENV_VAR as STALL_ENV_VAR
from .transport import split_into

__all__ = ["FanfoldProcessGroup", "register", "BACKEND"]

BACKEND = "fanfold"
_SUM, _AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
_FAST_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max",
             dist.ReduceOp.PRODUCT: "product"}
# the header codes of the ops only gloo computes (engine.Header.reduce_name)
_GLOO_ONLY_OPS = {dist.ReduceOp.BAND: 4, dist.ReduceOp.BOR: 5, dist.ReduceOp.BXOR: 6, dist.ReduceOp.PREMUL_SUM: 7}
_OTHER_OP = 8


def _op_name(op: Any) -> str | None:
    """"sum", "avg", "min", "max" or "product" for the reductions the shared memory computes (fixed rank order,
    bitwise equal on every rank); None for the rest (bitwise ops, PREMUL_SUM: gloo's)."""
    return next((name for fast, name in _FAST_OPS.items() if op == fast), None)


def _supported(tensors: list[torch.Tensor], op: str | None = "sum") -> bool:
    """Whether shared memory takes ``tensors``: CPU, one supported dtype; averages of floating point only."""
    if not tensors or op is None:
        return False
    dtype = tensors[0].dtype
    return all(t.device.type == "cpu" and t.dtype == dtype and not t.is_sparse for t in tensors) and (
        dtype in DTYPES and (op != "avg" or dtype.is_floating_point))


def _reduce_code(op: Any) -> int:
    # the code a header gives torch's ReduceOp: shared memory's, an average as the sum it is there; gloo's own ops
    name = _op_name(op)
    if name is not None:
        return reduce_code("sum" if name == "avg" else name)
    return next((code for gloo, code in _GLOO_ONLY_OPS.items() if op == gloo), _OTHER_OP)


def _shape(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}".replace("torch.", "")


def _of(kind: type, x: Any) -> Any:
    # a TypeError: the form does not bind, as an argument pybind refuses
    if not isinstance(x, kind):
        raise TypeError
    return x


def _tensor(x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError
    return x


def _tensors(x: Any, each: Callable[[Any], Any] = _tensor) -> list:
    if isinstance(x, torch.Tensor) or not isinstance(x, Sequence):
        raise TypeError
    return [each(t) for t in x]


def _lists(x: Any) -> list[list[torch.Tensor]]:
    return _tensors(x, _tensors)


def _opts(kind: type, opts: Any) -> Any:
    return kind() if opts is None else _of(kind, opts)


def _made(kind: type, timeout: timedelta | None, **fields: Any) -> Any:
    if "reduceOp" in fields:
        _of((dist.ReduceOp, dist.ReduceOp.RedOpType), fields["reduceOp"])
    opts = kind()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout is not None:
        opts.timeout = _of(timedelta, timeout)
    return opts


def _read(name: str, args: tuple, kwargs: dict) -> tuple:
    """The arguments of torch's method ``name`` as its first binding form (as pybind takes it) reads them: the
    tensors (and split sizes), then the options object; none binds: a TypeError listing torch's forms. A Python
    override replaces every pybind overload at once (torch's DDP calls ``process_group.allreduce(tensor)``)."""
    forms = _FORMS[name]
    for form in forms:
        try:
            return form(*args, **kwargs)
        except TypeError:  # the arguments do not bind (or an option refused its value)
            continue
    accepted = "; ".join(f"{name}{inspect.signature(f)}" for f in forms)
    given = ", ".join([type(a).__name__ for a in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()])
    raise TypeError(f"{name}(): incompatible function arguments ({given}); the fanfold backend takes torch's forms: "
                    f"{accepted}")


# Each of torch's overloads, with its parameter names and defaults (the error lists them), in pybind's order: the
# first is the one torch.distributed and torch's C++ use, so it binds at the first try.
_FORMS: dict[str, tuple[Callable[..., tuple], ...]] = {
    "allreduce": (
        lambda tensors, opts=None: (_tensors(tensors), _opts(AllreduceOptions, opts)),
        lambda tensors, op=_SUM, timeout=None: (_tensors(tensors), _made(AllreduceOptions, timeout, reduceOp=op)),
        lambda tensor, op=_SUM, timeout=None: ([_tensor(tensor)], _made(AllreduceOptions, timeout, reduceOp=op)),
    ),
    "allreduce_coalesced": (
        lambda tensors, opts=None: (_tensors(tensors), _opts(AllreduceCoalescedOptions, opts)),
    ),
    "broadcast": (
        lambda tensors, opts=None: (_tensors(tensors), _opts(BroadcastOptions, opts)),
        lambda tensor, root, timeout=None: (
            [_tensor(tensor)], _made(BroadcastOptions, timeout, rootRank=_of(int, root), rootTensor=0)),
    ),
    "allgather": (
        lambda output_tensors, input_tensors, opts=None: (
            _lists(output_tensors), _tensors(input_tensors), _opts(AllgatherOptions, opts)),
        lambda output_tensors, input_tensor, timeout=None: (
            [_tensors(output_tensors)], [_tensor(input_tensor)], _made(AllgatherOptions, timeout)),
    ),
    "all_gather_single": (
        lambda output, input, opts=None: (_tensor(output), _tensor(input), _opts(AllgatherOptions, opts)),
    ),
    "reduce_scatter": (
        lambda output_tensors, input_tensors, opts=None: (
            _tensors(output_tensors), _lists(input_tensors), _opts(ReduceScatterOptions, opts)),
        lambda output, input, op=_SUM, timeout=None: (
            [_tensor(output)], [_tensors(input)], _made(ReduceScatterOptions, timeout, reduceOp=op)),
    ),
    "reduce_scatter_single": (
        lambda outputTensor, inputTensor, opts=None: (  # noqa: N803 - torch's keyword names
            _tensor(outputTensor), _tensor(inputTensor), _opts(ReduceScatterOptions, opts)),
    ),
    "all_to_all_single": (
        lambda output, input, output_split_sizes, input_split_sizes, opts=None: (
            _tensor(output), _tensor(input), list(output_split_sizes), list(input_split_sizes),
            _opts(AllToAllOptions, opts)),
        lambda output, input, output_split_sizes, input_split_sizes, timeout=None: (
            _tensor(output), _tensor(input), list(output_split_sizes), list(input_split_sizes),
            _made(AllToAllOptions, timeout)),
    ),
    "alltoall": (
        lambda output_tensor, input_tensor, opts=None: (
            _tensors(output_tensor), _tensors(input_tensor), _opts(AllToAllOptions, opts)),
        lambda output, input, timeout=None: (_tensors(output), _tensors(input), _made(AllToAllOptions, timeout)),
    ),
    "barrier": (
        lambda opts=None: (_opts(BarrierOptions, opts),),
        lambda timeout=None: (_made(BarrierOptions, timeout),),
    ),
}


def _all_to_all_counts(output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int],
                       n: int) -> tuple[list[int], list[int]] | None:
    """all_to_all_single's element counts (sent to each rank, received from each rank) from torch's split sizes
    (rows of dim 0; empty: equal parts), or None where they do not describe the tensors (gloo says why)."""
    if input.dim() == 0 or output.dim() == 0:
        return None
    counts = []
    for t, splits in ((input, in_splits), (output, out_splits)):
        rows = t.shape[0]
        if not splits:
            if rows % n:
                return None
            splits = [rows // n] * n
        if len(splits) != n or sum(splits) != rows or min(splits) < 0:
            return None
        row = t.numel() // rows if rows else 0
        counts.append([k * row for k in splits])
    return counts[0], counts[1]


# the reductions whose first argument holds the outputs an average divides
_AVERAGING = ("allreduce", "allreduce_coalesced", "reduce_scatter", "reduce_scatter_single")


def _integer_average(first: Any, opts: Any) -> list[torch.Tensor] | None:
    """The output tensors of a reduction (``first``: its first argument) that is an AVG of integer tensors (bool
    excluded: gloo's), else None."""
    if opts.reduceOp != _AVG:
        return None
    outputs = [first] if isinstance(first, torch.Tensor) else list(first)
    if not outputs or any(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in outputs):
        return None
    return outputs


def _divided(work: dist.Work, outputs: list[torch.Tensor], size: int) -> dist.Work:
    """``work``'s sums divided by the group's ``size`` as NCCL divides an integer AVG: C's integer division,
    rounded toward zero (-7 // 2 is -3), of the sum wrapped around in the tensor's dtype. Waited for here, as a
    broadcast is: integer averages are metrics and counters, small and rare; an error is the Work's, raised by
    ``wait()``."""
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - raised by wait(), as the collective's own errors are
        return failed_work(exc, outputs)
    for t in outputs:
        t.copy_(torch.div(t, size, rounding_mode="trunc"))
    return completed_work(outputs)


def _torch_method(name: str, impl: Callable[..., dist.Work | None], gloo: str | None = None
                  ) -> Callable[..., dist.Work]:
    """torch's ``ProcessGroup`` method ``name``, in every calling form (``_read``), running ``impl``, else the gloo
    backend's method ``gloo`` (default ``name``) with the same arguments, bounded by ``_wait_limit``. Under
    torch.compile dynamo calls it instead of tracing into it (torch's DDP broadcasts its buffers from the traced
    forward): a collective runs the transport's threads, locks and futures, which no graph holds."""

    def method(self: FanfoldProcessGroup, *args: Any, **kwargs: Any) -> dist.Work:
        if torch.compiler.is_compiling():  # a graph break to ``eager``; outside dynamo, no disable wrapper a call
            return eager(method, self, *args, **kwargs)
        *arguments, opts = _read(name, args, kwargs)
        outputs = _integer_average(arguments[0], opts) if name in _AVERAGING else None
        if outputs is not None:  # NCCL's integer AVG: the sum (shared memory's or gloo's), then divided here
            opts.reduceOp = _SUM
            try:
                work = _divided(run(self, arguments, opts), outputs, self.size())
            finally:
                opts.reduceOp = _AVG
            return self._handout(work, opts.asyncOp)
        return self._handout(run(self, arguments, opts), opts.asyncOp)

    def run(self: FanfoldProcessGroup, arguments: list, opts: Any) -> dist.Work:
        work = impl(self, *arguments, opts)
        if work is None:
            # gloo ends a collective after its options' timeout and closes its connections: the peers' waits end too
            opts.timeout = timedelta(seconds=self._wait_limit()[0])
            work = getattr(self.gloo, gloo or name)(*arguments, opts)
        return work

    method.__name__ = method.__qualname__ = name
    return method


class _Handout(dist.ProcessGroup):
    """``handout(work, async_op)``: the Work a collective of the group returns, safe to hand to torch's C++ (a Work
    written in Python dies with its Python half: docs/backend.md). Completed at return: torch's future-backed Work.
    Failed or in flight: what torch's C++ makes of the Work this group of one's only collective returns, its holder
    of the Python Work (``PyWorkHolder``), whose ``wait(timeout)`` and ``get_future()`` are ``work``'s."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.given = threading.local()  # per thread: collectives may be issued from several

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self.given.work

    def __call__(self, work: dist.Work, async_op: bool) -> dist.Work:
        if not async_op or not isinstance(work, FanfoldWork):
            return work  # waited for at once, or gloo's (C++ through and through)
        if work.is_completed() and work.exception() is None:
            return _create_work_from_future(work.get_future())
        self.given.work = work
        try:
            return dist.ProcessGroup.allreduce(self, [], dist.AllreduceOptions())
        finally:
            self.given.work = None


class FanfoldProcessGroup(dist.ProcessGroup):
    """The process group behind ``init_process_group("fanfold")`` and ``new_group(backend="fanfold")``.

    ``store``, ``rank``, ``world_size`` and ``timeout`` are torch's (the creator's arguments). :attr:`gloo` is the
    inner gloo backend, :attr:`transport` the group's transport once created (``ShmTransport`` on one host,
    ``HierarchicalTransport`` across hosts; None before the first fast collective, or with one rank per host):
    fanfold's own DDP can take it from the group."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta):
        refuse_unwrapped(world_size)  # Accelerate's silent single-replica mode, refused before any connection
        super().__init__(rank, world_size)
        self._store, self._timeout = store, timeout
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        # The C++ side sends every collective without a Python override here (and CUDA tensors: gloo's).
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        if torch.cuda.is_available():
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.transport: Transport | None = None
        self._decided = False
        self._lock = threading.Lock()
        self._handout = _Handout()
        self._done = completed_work([])  # a synchronous call's Work is only waited for: one for all
        self._barriers = 0  # this rank's barriers through the store (the n-th of every rank meet)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def shared_transport(self) -> Transport | None:
        """``protocol.TransportOwner``: the group's transport, created at the first call (collective: every rank
        makes the same first fast collective); None with one rank per host, or where it is turned off."""
        if self._decided:  # set once, under the lock, after transport: no lock on every collective
            return self.transport
        with self._lock:
            if not self._decided:  # decided once created (a rank that timed out waiting for its peers retries)
                self.transport = self._create()
                self._decided = True
            return self.transport

    def _create(self) -> Transport | None:
        rank, size = self.rank(), self.size()
        if size == 1:
            return None
        store = dist.PrefixStore("fanfold/backend/", self._store)
        asked = os.environ.get(ENV_VAR) or None
        limit, source = self._wait_limit()
        views = host_views(store, rank, size, asked, platform.machine().lower() in ("x86_64", "amd64"), limit,
                           f"fanfold backend's first shared-memory collective ({source})")
        if asked == "torch":
            return None
        choice, reason = choose(views)
        if asked is not None and choice != asked:
            local = all(v[2] for v in views)
            if not local or asked == "shm":  # the hierarchical transport may be asked for on any hosts
                raise RuntimeError(f"rank {rank}: ${ENV_VAR}={asked}, but "
                                   f"{'the ranks run on different hosts' if local else reason}")
            choice, reason = asked, None
        if reason is not None:
            warnings.warn(f"fanfold backend (rank {rank}): every collective goes through gloo: {reason}",
                          stacklevel=3)
            return None
        group = StoreGroup(store, rank, size, self._timeout.total_seconds())
        if choice == "hierarchical":
            return HierarchicalTransport(group)  # a host short of /dev/shm raises: its peers on other hosts do not
        try:
            return ShmTransport(group)
        except SegmentSpaceError as exc:  # every rank raises it
            if asked == "shm":
                raise
            if rank == 0:
                warnings.warn(f"fanfold backend: every collective goes through gloo: {exc}", stacklevel=3)
            return None

    def _wait_limit(self) -> tuple[float, str]:
        """How long a wait for a peer may take now (``timeouts.bound``), and what set it."""
        group = self._timeout.total_seconds()
        seconds = bound(resolve_stall_timeout(), group)
        if seconds < group:
            return seconds, f"the stall timeout (${STALL_ENV_VAR}, default {DEFAULT_STALL_TIMEOUT:g} s)"
        return group, "the timeout of the group"

    # The implementations: None where the call goes to gloo as it is. Each first takes the group's transport (every
    # rank alike), then runs the call in shared memory where this rank's tensors allow it; else this rank claims the
    # collective in shared memory (``_claim``) before it goes to gloo: a rank whose tensors differ from its peers'
    # (sizes, dtypes, op, device) meets them at the first step of theirs, and every rank raises ShmMismatchError.

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work | None:
        # The latency path, tried once, with as few checks as make it safe (run_small checks the tensor): a small
        # SUM, or AVG of floating point, summed on this thread when nothing is queued. Anything else is queued.
        if len(tensors) == 1 and self._decided and isinstance(self.transport, ShmTransport):
            t, op = tensors[0], opts.reduceOp
            try:
                if (op == _SUM and self.transport.run_small(t)) or (
                        op == _AVG and t.is_floating_point() and self.transport.run_small(t, self.size())):
                    return completed_work(tensors) if opts.asyncOp else self._done
            except Exception as exc:  # noqa: BLE001 - raised by wait(), as gloo's errors are
                return failed_work(exc, tensors)
        op = _op_name(opts.reduceOp)
        if (shm := self.shared_transport()) is None:
            return None
        if len(tensors) == 1 and _supported(tensors, op):
            # detach: collectives write a tensor's data whatever autograd thinks of it (a Parameter), as gloo does
            return shm.all_reduce(tensors[0].detach(), **self._reduction(op)).chain(tensors)
        return self._claim(shm, Op.ALL_REDUCE, tensors, tensors, reduce=opts.reduceOp, several=len(tensors) != 1)

    def _allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work | None:
        op = _op_name(opts.reduceOp)
        if (shm := self.shared_transport()) is None:
            return None
        if _supported(tensors, op):
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            return shm.all_reduce(flat, **self._reduction(op)).chain(tensors, lambda: split_into(flat, tensors))
        return self._claim(shm, Op.ALL_REDUCE, tensors, tensors, reduce=opts.reduceOp)

    def _broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work | None:
        if (shm := self.shared_transport()) is None:
            return None
        several = len(tensors) != 1 or opts.rootTensor != 0  # gloo's form of several tensors
        if not several and _supported(tensors):
            shm.broadcast(tensors[0].detach(), opts.rootRank)  # returns once done: broadcasts are rare and small
            return completed_work(tensors)
        return self._claim(shm, Op.BROADCAST, tensors, tensors, src=opts.rootRank, several=several)

    def _allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                   opts: Any) -> dist.Work | None:
        if (shm := self.shared_transport()) is None:
            return None
        if len(output_tensors) != 1 or len(input_tensors) != 1:  # gloo's form of several inputs
            return self._claim(shm, Op.ALL_GATHER, input_tensors, output_tensors, several=True)
        x, outs = input_tensors[0], output_tensors[0]
        why = None
        if len(outs) != self.size() or any(o.shape != x.shape or o.dtype != x.dtype for o in outs):
            why = (f"all_gather: rank {self.rank()}'s input is {_shape(x)}; its {len(outs)} outputs are "
                   f"{', '.join(_shape(o) for o in outs) or 'none'}: the group's {self.size()} ranks need "
                   f"{self.size()} outputs of the input's shape and dtype")
        if why is None and _supported([x]):
            flat = torch.empty(self.size() * x.numel(), dtype=x.dtype)
            work = shm.all_gather(x.detach(), flat)
            return work.chain(output_tensors, lambda: split_into(flat, outs))
        return self._claim(shm, Op.ALL_GATHER, [x], output_tensors, why)

    def _all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work | None:
        if (shm := self.shared_transport()) is None:
            return None
        why = None
        if output.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            why = (f"all_gather_into_tensor: rank {self.rank()}'s input is {_shape(input)}, its output "
                   f"{_shape(output)}: the output needs the input's dtype and {self.size()} x {input.numel()} = "
                   f"{self.size() * input.numel()} elements (the group's size times the input's)")
        if why is None and _supported([input, output]):
            return shm.all_gather(input.detach(), output.detach()).chain([output])
        return self._claim(shm, Op.ALL_GATHER, [input], [output], why)

    def _reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                        opts: Any) -> dist.Work | None:
        op = _op_name(opts.reduceOp)
        if (shm := self.shared_transport()) is None:
            return None
        if len(input_tensors) != 1 or len(output_tensors) != 1:  # gloo's form of several outputs
            return self._claim(shm, Op.REDUCE_SCATTER, [t for ins in input_tensors for t in ins], output_tensors,
                               reduce=opts.reduceOp, several=True)
        ins, out = input_tensors[0], output_tensors[0]
        why = None
        if len(ins) != self.size() or any(t.shape != out.shape or t.dtype != out.dtype for t in ins):
            why = (f"reduce_scatter: rank {self.rank()}'s output is {_shape(out)}; its {len(ins)} inputs are "
                   f"{', '.join(_shape(t) for t in ins) or 'none'}: the group's {self.size()} ranks need "
                   f"{self.size()} inputs of the output's shape and dtype")
        if why is None and _supported([out], op):
            flat = torch.cat([t.detach().reshape(-1) for t in ins])
            work = shm.reduce_scatter(flat, out.detach(), **self._reduction(op))
            return work.chain(output_tensors)
        return self._claim(shm, Op.REDUCE_SCATTER, ins, output_tensors, why, reduce=opts.reduceOp)

    def _reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work | None:
        op = _op_name(opts.reduceOp)
        if (shm := self.shared_transport()) is None:
            return None
        why = None
        if input.numel() != self.size() * output.numel() or output.dtype != input.dtype:
            why = (f"reduce_scatter_tensor: rank {self.rank()}'s input is {_shape(input)}, its output "
                   f"{_shape(output)}: the input needs the output's dtype and {self.size()} x {output.numel()} = "
                   f"{self.size() * output.numel()} elements (the group's size times the output's)")
        if why is None and _supported([input, output], op):
            work = shm.reduce_scatter(input.detach(), output.detach(), **self._reduction(op))
            return work.chain([output])
        return self._claim(shm, Op.REDUCE_SCATTER, [input], [output], why, reduce=opts.reduceOp)

    def _all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                           input_split_sizes: list[int], opts: Any) -> dist.Work | None:
        if (shm := self.shared_transport()) is None:
            return None
        counts = _all_to_all_counts(output, input, output_split_sizes, input_split_sizes, self.size())
        why = None
        if counts is None or output.dtype != input.dtype:
            why = (f"all_to_all_single: rank {self.rank()}'s input is {_shape(input)} split "
                   f"{input_split_sizes or 'equally'}, its output {_shape(output)} split "
                   f"{output_split_sizes or 'equally'}: each needs {self.size()} splits of its dim 0 (or none: "
                   "equal parts), and one dtype for both")
        # the hierarchical transport has no all_to_all: gloo's
        if why is None and isinstance(shm, ShmTransport) and _supported([input, output]):
            work = shm.all_to_all(input.detach(), output.detach(), counts[0], counts[1])
            return work.chain([output])
        # every rank's splits are checked against its peers' where gloo's would be; a claim's size is none
        return self._claim(shm, Op.ALL_TO_ALL, [input], [output], why, numel=0)

    def _alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                  opts: Any) -> dist.Work | None:
        # the list form: the tensors laid end to end, each rank's count the tensor's, as all_to_all_single's
        if (shm := self.shared_transport()) is None:
            return None
        n, x = self.size(), input_tensors[0] if input_tensors else None
        why = None
        if len(input_tensors) != n or len(output_tensors) != n or any(
                t.dtype != x.dtype for t in input_tensors + output_tensors):
            why = (f"all_to_all: rank {self.rank()} passes {len(input_tensors)} inputs and {len(output_tensors)} "
                   f"outputs of dtypes {sorted({str(t.dtype) for t in input_tensors + output_tensors})}: the group's "
                   f"{n} ranks need {n} of each, of one dtype")
        if why is None and isinstance(shm, ShmTransport) and _supported(input_tensors + output_tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in input_tensors])
            out = torch.empty(sum(t.numel() for t in output_tensors), dtype=x.dtype)
            work = shm.all_to_all(flat, out, [t.numel() for t in input_tensors], [t.numel() for t in output_tensors])
            return work.chain(output_tensors, lambda: split_into(out, output_tensors))
        return self._claim(shm, Op.ALL_TO_ALL, input_tensors, output_tensors, why, numel=0)

    def _reduction(self, op: str) -> dict:
        # an average is a sum with a divisor
        return {"op": "sum", "divisor": self.size()} if op == "avg" else {"op": op, "divisor": None}

    def _claim(self, shm: Transport, op: Op, tensors: list[torch.Tensor], result: Any, why: str | None = None, *,
               reduce: Any = _SUM, src: int = 0, numel: int | None = None, several: bool = False
               ) -> dist.Work | None:
        """A collective this rank does not run in shared memory: ``why`` None, its tensors are for gloo (a dtype,
        op, device or form the shared memory does not take); else they do not fit together (``why`` says how).
        Claimed in shared memory (``ShmTransport.claim``) with what the shared-memory path would publish: None (gloo
        runs it) once every rank handed the same to gloo; ValueError ``why`` where every rank refused it; a failed
        Work (``ShmMismatchError``, raised by ``wait()``) where the ranks differ, as on the peers. One step of the
        transport (a few microseconds), on these calls only."""
        if not isinstance(shm, ShmTransport):  # the hierarchical transport claims nothing: gloo's, as before
            if why is not None:
                raise ValueError(why)
            return None
        dtype = tensors[0].dtype if tensors else None
        claim = Claim(op | (GLOO if why is None else REFUSED), dtype,
                      sum(t.numel() for t in tensors) if numel is None else numel, _reduce_code(reduce), src,
                      len(tensors) if several else 0)
        try:
            shm.claim(claim)
        except ShmMismatchError as exc:
            if why is not None:  # this rank's own reason, besides what its peers are in
                exc = ShmMismatchError(f"{exc}; {why}", rank=exc.rank, peer=exc.peer, seq=exc.seq,
                                       seq_text=exc.seq_text, field=exc.field, detail=exc.detail)
            return failed_work(exc, result)
        except Exception as exc:  # noqa: BLE001 - a stall, a dead peer: raised by wait(), as a collective's errors
            return failed_work(exc, result)
        if why is not None:
            raise ValueError(why)
        return None

    def _barrier(self, opts: Any) -> None:
        shm = self.shared_transport()
        if shm is not None:
            shm.barrier()  # every rank has finished its queued shared-memory collectives (names a missing one)
        else:
            self._store_barrier()  # gloo's own would time out naming nobody
        # then gloo's, behind the delegated collectives queued before it

    def _store_barrier(self) -> None:
        self._barriers += 1
        n, rank, size = self._barriers, self.rank(), self.size()
        store = dist.PrefixStore(f"fanfold/barrier/{n}/", self._store)
        store.set(str(rank), "1")
        limit, source = self._wait_limit()
        try:
            store.wait([str(r) for r in range(size)], timedelta(seconds=limit))
        except RuntimeError as exc:  # the store's "Wait timeout": say who
            missing = [r for r in range(size) if not store.check([str(r)])]
            if not missing:  # every rank came just after the wait's end: the barrier is passed
                return
            raise StallError(
                f"fanfold backend: rank {rank} of {size}: barrier #{n} Timed out after {limit:g} s ({source}) "
                f"waiting for ranks {missing}, which never arrived", rank=rank, seq=n, kind="barrier",
                bucket=None, missing=missing, feature="fanfold backend") from exc

    # torch's methods, in every calling form (_FORMS), each handing out a Work that is safe in C++ (_Handout)
    allreduce = _torch_method("allreduce", _allreduce)
    allreduce_coalesced = _torch_method("allreduce_coalesced", _allreduce_coalesced)
    broadcast = _torch_method("broadcast", _broadcast)
    allgather = _torch_method("allgather", _allgather)
    all_gather_single = _allgather_base = _torch_method("all_gather_single", _all_gather_single, "_allgather_base")
    reduce_scatter = _torch_method("reduce_scatter", _reduce_scatter)
    reduce_scatter_single = _reduce_scatter_base = _torch_method("reduce_scatter_single", _reduce_scatter_single,
                                                                 "_reduce_scatter_base")
    all_to_all_single = alltoall_base = _torch_method("all_to_all_single", _all_to_all_single, "alltoall_base")
    alltoall = _torch_method("alltoall", _alltoall)
    barrier = _torch_method("barrier", _barrier)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: AllgatherOptions | None = None) -> dist.Work:
        return self._pairwise("all_gather_into_tensor_coalesced", self.all_gather_single, Op.ALL_GATHER,
                              _tensors(outputs), _tensors(inputs), opts or AllgatherOptions())

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: ReduceScatterOptions | None = None) -> dist.Work:
        return self._pairwise("reduce_scatter_tensor_coalesced", self.reduce_scatter_single, Op.REDUCE_SCATTER,
                              _tensors(outputs), _tensors(inputs), opts or ReduceScatterOptions())

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: AllgatherOptions | None = None) -> dist.Work:
        # torch's all_gather_coalesced: output_lists[r][i] receives rank r's input i; input by input, as all_gather
        outputs, inputs = _lists(output_lists), _tensors(input_list)
        if any(len(outs) != len(inputs) for outs in outputs):
            outputs = []  # refused below, as lists that do not pair up
        by_input = [[outs[i] for outs in outputs] for i in range(len(inputs))] if outputs else []
        return self._pairwise("all_gather_coalesced", lambda outs, x, o: self.allgather([outs], [x], o),
                              Op.ALL_GATHER, by_input, inputs, opts or AllgatherOptions())

    def _pairwise(self, name: str, method: Callable[..., dist.Work], op: Op, outputs: list, inputs: list[torch.Tensor],
                  opts: Any) -> dist.Work:
        # torch's functional collectives (DTensor's redistribute and full_tensor(), FSDP2's) call the coalesced
        # forms. Left to torch's C++, they went into gloo's queue with the caller holding the GIL, while a gloo
        # worker freeing the previous work (its tensors' Python objects) took the GIL under the queue's lock: a
        # deadlock until gloo's timeout. Pair by pair through the group's methods, they take the transport like
        # every other collective, and gloo's Python binding, which lets the GIL go, where it does not take them.
        if len(outputs) != len(inputs):
            why = f"{name}: rank {self.rank()} passes outputs that do not pair with its {len(inputs)} input tensors"
            if (shm := self.shared_transport()) is None:
                raise ValueError(why)
            # refused in shared memory, where the peers' first pair meets it (ValueError where every rank refused)
            return self._handout(self._claim(shm, op, inputs[:1], outputs, why,
                                             reduce=getattr(opts, "reduceOp", _SUM)), True)
        works = [method(out, inp, opts) for out, inp in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1] if works else self._done

    def shutdown(self) -> None:
        """Close the transport (its queued collectives finish first), then torch's own shutdown (gloo's)."""
        if self.transport is not None:
            self.transport.close()
        super().shutdown()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.close()
        super().abort()

    def __repr__(self) -> str:
        return f"FanfoldProcessGroup(rank={self.rank()}, size={self.size()}, shm={self.transport is not None})"


def register() -> None:
    """Register the ``fanfold`` backend with torch.distributed for CPU tensors (done by ``import fanfold``;
    idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, FanfoldProcessGroup, devices=["cpu"])
