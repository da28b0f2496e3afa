"""The reductions of the shm transport besides the sum: MIN, MAX and PRODUCT, folded in rank order.

Layer: the bottom of ``shm/`` (no imports from the package); ``request`` carries the op's code in a
:class:`~fanfold.collectives.shm.request.Collective` and its header, ``engine.Engine.sum_into`` hands every
non-sum reduction here. The sum stays the engine's own (with its divisor for averages).

Every rank folds the ranks' values in rank order, so the bits depend only on the inputs: equal on every rank. MIN
and MAX are exact in any dtype; a NaN on any rank gives NaN (``torch.minimum`` / ``torch.maximum``), and the sign
of a zero chosen between +0 and -0 is torch's. PRODUCT rounds like the sum: two half-precision values are
multiplied in float32 and rounded once (torch's own ``mul``), more are multiplied in float32 and rounded once at
the end; integers wrap around as torch's ``mul`` does.
"""
from __future__ import annotations

import torch

__all__ = ["SUM", "MIN", "MAX", "PRODUCT", "REDUCE_OPS", "reduce_code", "combine"]

SUM, MIN, MAX, PRODUCT = range(4)  # SUM is 0: the code of a collective that reduces nothing, too
REDUCE_OPS = {SUM: "sum", MIN: "min", MAX: "max", PRODUCT: "product"}
_CODES = {name: code for code, name in REDUCE_OPS.items()}
_FOLD = {MIN: torch.minimum, MAX: torch.maximum, PRODUCT: torch.mul}
_HALVES = (torch.bfloat16, torch.float16)


def reduce_code(op: str, divisor: float | None = None) -> int:
    """The code of reduction ``op`` ("sum", "min", "max" or "product"); a ``divisor`` goes with "sum" only."""
    if op not in _CODES:
        raise ValueError(f"op must be one of {sorted(_CODES)}, got {op!r}")
    if divisor is not None and op != "sum":
        raise ValueError(f"a divisor (an average) goes with op='sum' only, got op={op!r} and divisor={divisor!r}")
    return _CODES[op]


def combine(parts: list[torch.Tensor], out: torch.Tensor, op: int, scratch: torch.Tensor) -> None:
    """``out`` = ``parts[0]`` op ``parts[1]`` op ... in rank order, for op MIN, MAX or PRODUCT. ``out`` may be one
    of ``parts`` (a rank's own copy in shared memory); ``scratch``: float32 memory for at least ``out.numel()``
    values."""
    fold = _FOLD[op]
    if op == PRODUCT and out.dtype in _HALVES and len(parts) > 2:
        acc, rest = scratch[: out.numel()].copy_(parts[0]), parts[1:]  # several halves: in float32, rounded once
    elif any(p.data_ptr() == out.data_ptr() for p in parts[2:]):
        acc, rest = fold(parts[0], parts[1]), parts[2:]  # out is a later rank's own copy: read it before writing it
    else:
        acc, rest = fold(parts[0], parts[1], out=out), parts[2:]
    for p in rest:
        fold(acc, p, out=acc)
    if acc is not out:
        out.copy_(acc)
