"""torch's ``delay_all_reduce_named_params``: parameters left out of the buckets, averaged in one flat all-reduce.

Used by the reducer (``reducer.py``) at the end of each synchronised backward, after the buckets are launched; a
rank that has joined (``join.py``) issues the same all-reduce with zeros. torch issues it when the gradient of
``param_to_hook_all_reduce`` is computed and does not wait for it; fanfold issues it at a point every rank reaches
in the same order (the end of backward) and waits for it before the gradients are handed back: the same average.
As torch's, it divides by the world size, also inside ``join(divide_by_initial_world_size=False)``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["reduce_delayed"]


def reduce_delayed(all_reduce: Callable[..., Any], params: Sequence[torch.Tensor], divisor: float,
                   shadow: bool = False, dtype: torch.dtype | None = None) -> Callable[[], None]:
    """Start the all-reduce of ``params``' gradients in ``dtype`` (default: the first one's; zeros for a missing
    one, or for all when ``shadow``); return the function that waits and writes the averages into ``.grad``
    (nothing when ``shadow``)."""
    if not params:
        return lambda: None
    dtype = dtype or params[0].dtype
    flat = torch.cat([torch.zeros(p.numel(), dtype=dtype, device=p.device) if p.grad is None or shadow
                      else p.grad.detach().reshape(-1).to(dtype) for p in params])
    handle = all_reduce(flat, None, divisor)

    def write_back() -> None:
        handle.wait()
        offset = 0
        for p in params:
            avg = flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            if not shadow:
                p.grad = avg.to(p.dtype, copy=True) if p.grad is None else p.grad.detach().copy_(avg)

    return write_back
