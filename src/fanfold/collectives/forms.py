"""The calling forms of torch's ``ProcessGroup`` methods that the ``fanfold`` backend implements, each read into the
one form its implementation takes. A Python override replaces every pybind overload at once, so it accepts them all
(torch's DDP calls ``process_group.allreduce(tensor)``): the first form that binds is taken, as pybind does; none
binds: a ``TypeError`` listing torch's forms.
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

__all__ = ["read", "all_to_all_counts"]

_SUM = dist.ReduceOp.SUM


def _of(kind: type, x: Any) -> Any:
    """``x`` if it is a ``kind``; otherwise the form does not bind (TypeError, as an argument pybind refuses)."""
    if not isinstance(x, kind):
        raise TypeError
    return x


def _tensor(x: Any) -> torch.Tensor:
    return _of(torch.Tensor, x)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor) or not isinstance(x, Sequence):
        raise TypeError
    return [_tensor(t) for t in x]


def _lists(x: Any) -> list[list[torch.Tensor]]:
    if isinstance(x, torch.Tensor) or not isinstance(x, Sequence):
        raise TypeError
    return [_tensors(inner) for inner in x]


def _opts(kind: type, opts: Any) -> Any:
    """torch's options object as given; None (left out): the default."""
    return kind() if opts is None else _of(kind, opts)


def _made(kind: type, timeout: timedelta | None, **fields: Any) -> Any:
    """The options object of the keyword forms (``op=``, ``root=``, ``timeout=``)."""
    if "reduceOp" in fields:
        _of((dist.ReduceOp, dist.ReduceOp.RedOpType), fields["reduceOp"])
    opts = kind()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout is not None:
        opts.timeout = _of(timedelta, timeout)
    return opts


def read(name: str, args: tuple, kwargs: dict) -> tuple:
    """The arguments of torch's method ``name`` as its first binding form reads them: the tensors (and split sizes),
    then the options object."""
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
    "barrier": (
        lambda opts=None: (_opts(BarrierOptions, opts),),
        lambda timeout=None: (_made(BarrierOptions, timeout),),
    ),
}


def all_to_all_counts(output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int],
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
