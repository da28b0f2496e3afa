"""The calling forms of torch's ``ProcessGroup`` methods that the ``fanfold`` backend (``backend.py``) implements in
Python, each read into the one form its implementation takes: the tensors, then the options object.

torch's pybind methods are overloaded (``allreduce(tensors, opts)``, ``allreduce(tensors, op, timeout)``,
``allreduce(tensor, op, timeout)``, ``broadcast(tensor, root)``, ``barrier(timeout=...)``, ...). A Python override
replaces every overload at once, so it must accept them all: torch's DDP calls ``process_group.allreduce(tensor)``
from its join hook. Each form below has the overload's own parameter names and defaults; the first that binds the
arguments (and whose arguments have the right kinds: one tensor, a list of tensors, an options object) is taken, as
pybind does. None binds: a ``TypeError`` listing torch's forms. The first form of each is the one
``torch.distributed`` and torch's C++ use: it binds at the first try.

Layer: collectives, under ``backend.py``; torch only.
"""
from __future__ import annotations

import inspect
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
)

__all__ = ["allreduce", "allreduce_coalesced", "broadcast", "allgather", "all_gather_single", "reduce_scatter",
           "reduce_scatter_single", "all_to_all_single", "barrier"]

_SUM = dist.ReduceOp.SUM


class _NoMatch(Exception):
    pass


def _tensor(x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise _NoMatch
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor) or not isinstance(x, Sequence) or not all(isinstance(t, torch.Tensor) for t in x):
        raise _NoMatch
    return list(x)


def _lists(x: Any) -> list[list[torch.Tensor]]:
    if isinstance(x, torch.Tensor) or not isinstance(x, Sequence):
        raise _NoMatch
    return [_tensors(inner) for inner in x]


def _opts(kind: type, opts: Any) -> Any:
    """torch's options object as given; None (left out): the default."""
    if opts is None:
        return kind()
    if not isinstance(opts, kind):
        raise _NoMatch
    return opts


def _made(kind: type, timeout: timedelta | None, **fields: Any) -> Any:
    """The options object of the keyword forms (``op=``, ``root=``, ``timeout=``)."""
    if "reduceOp" in fields and not isinstance(fields["reduceOp"], (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        raise _NoMatch
    opts = kind()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout is not None:
        opts.timeout = timeout
    return opts


def _read(name: str, forms: list[Callable[..., tuple]], args: tuple, kwargs: dict) -> tuple:
    for form in forms:
        try:
            return form(*args, **kwargs)
        except (TypeError, _NoMatch):  # TypeError: the arguments do not bind (or an option refused its value)
            continue
    accepted = "; ".join(f"{name}{inspect.signature(f)}" for f in forms)
    given = ", ".join([type(a).__name__ for a in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()])
    raise TypeError(f"{name}(): incompatible function arguments ({given}); the fanfold backend takes torch's forms: "
                    f"{accepted}")


def _allreduce_opts(tensors, opts=None):
    return _tensors(tensors), _opts(AllreduceOptions, opts)


def _allreduce_op(tensors, op=_SUM, timeout=None):
    return _tensors(tensors), _made(AllreduceOptions, timeout, reduceOp=op)


def _allreduce_one(tensor, op=_SUM, timeout=None):
    return [_tensor(tensor)], _made(AllreduceOptions, timeout, reduceOp=op)


def allreduce(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    return _read("allreduce", [_allreduce_opts, _allreduce_op, _allreduce_one], args, kwargs)


def _allreduce_coalesced(tensors, opts=None):
    return _tensors(tensors), _opts(AllreduceCoalescedOptions, opts)


def allreduce_coalesced(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    return _read("allreduce_coalesced", [_allreduce_coalesced], args, kwargs)


def _broadcast_opts(tensors, opts=None):
    return _tensors(tensors), _opts(BroadcastOptions, opts)


def _broadcast_root(tensor, root, timeout=None):
    if not isinstance(root, int):
        raise _NoMatch
    return [_tensor(tensor)], _made(BroadcastOptions, timeout, rootRank=root, rootTensor=0)


def broadcast(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    return _read("broadcast", [_broadcast_opts, _broadcast_root], args, kwargs)


def _allgather_lists(output_tensors, input_tensors, opts=None):
    return _lists(output_tensors), _tensors(input_tensors), _opts(AllgatherOptions, opts)


def _allgather_one(output_tensors, input_tensor, timeout=None):
    return [_tensors(output_tensors)], [_tensor(input_tensor)], _made(AllgatherOptions, timeout)


def allgather(args: tuple, kwargs: dict) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], Any]:
    return _read("allgather", [_allgather_lists, _allgather_one], args, kwargs)


def _all_gather_single(output, input, opts=None):
    return _tensor(output), _tensor(input), _opts(AllgatherOptions, opts)


def all_gather_single(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    return _read("all_gather_single", [_all_gather_single], args, kwargs)


def _reduce_scatter_lists(output_tensors, input_tensors, opts=None):
    return _tensors(output_tensors), _lists(input_tensors), _opts(ReduceScatterOptions, opts)


def _reduce_scatter_one(output, input, op=_SUM, timeout=None):
    return [_tensor(output)], [_tensors(input)], _made(ReduceScatterOptions, timeout, reduceOp=op)


def reduce_scatter(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    return _read("reduce_scatter", [_reduce_scatter_lists, _reduce_scatter_one], args, kwargs)


def _reduce_scatter_single(outputTensor, inputTensor, opts=None):  # noqa: N803 - torch's keyword names
    return _tensor(outputTensor), _tensor(inputTensor), _opts(ReduceScatterOptions, opts)


def reduce_scatter_single(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    return _read("reduce_scatter_single", [_reduce_scatter_single], args, kwargs)


def _all_to_all_opts(output, input, output_split_sizes, input_split_sizes, opts=None):
    return (_tensor(output), _tensor(input), list(output_split_sizes), list(input_split_sizes),
            _opts(AllToAllOptions, opts))


def _all_to_all_timeout(output, input, output_split_sizes, input_split_sizes, timeout=None):
    if timeout is not None and not isinstance(timeout, timedelta):
        raise _NoMatch
    return (_tensor(output), _tensor(input), list(output_split_sizes), list(input_split_sizes),
            _made(AllToAllOptions, timeout))


def all_to_all_single(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], Any]:
    return _read("all_to_all_single", [_all_to_all_opts, _all_to_all_timeout], args, kwargs)


def _barrier_opts(opts=None):
    return (_opts(BarrierOptions, opts),)


def _barrier_timeout(timeout=None):
    if timeout is not None and not isinstance(timeout, timedelta):
        raise _NoMatch
    return (_made(BarrierOptions, timeout),)


def barrier(args: tuple, kwargs: dict) -> tuple[Any]:
    return _read("barrier", [_barrier_opts, _barrier_timeout], args, kwargs)
