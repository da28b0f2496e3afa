"""Optimizers in backward: torch's private ``torch.distributed.optim._apply_optimizer_in_backward`` under DDP.

That function gives a parameter optimizers of its own (``param._in_backward_optimizers``) and a hook that steps
them as soon as the parameter's gradient is accumulated, then sets ``.grad`` to None. Under DDP that gradient is
this rank's alone, so torch's DDP takes such parameters over at its first forward: it removes those hooks and steps
the optimizers on the averaged gradient. fanfold's does the same: ``take_over`` finds the parameters and removes
the hooks, the reducer steps the optimizers once the buckets are averaged (``Reducer._step_in_backward``).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["take_over", "refusal"]

_TORCH_MODULE = "torch.distributed.optim.apply_optimizer_in_backward"


def refusal(rank: int, names: Sequence[str], what: str) -> RuntimeError:
    """The error for ``what`` (a feature, and why it cannot be) with optimizers in backward on ``names``."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return RuntimeError(
        f"DistributedDataParallel (rank {rank}): {what}; it cannot be combined with optimizers applied in backward "
        f"(torch.distributed.optim._apply_optimizer_in_backward), which DDP steps on the averaged gradient. "
        f"Parameters with such optimizers: {shown}.")


def take_over(params: Sequence[torch.Tensor], names: Sequence[str], rank: int, conflict: str | None) -> list[int]:
    """The indices of ``params`` that carry optimizers in backward, whose own hooks are removed: from now on DDP
    steps them. ``conflict``: what DDP is set up with that refuses them (a comm hook, ...), or None."""
    found = [i for i, p in enumerate(params) if hasattr(p, "_in_backward_optimizers")]
    if not found:
        return found
    if conflict is not None:
        raise refusal(rank, [names[i] for i in found], conflict)
    # The handles live in torch's module, which the user imported to call _apply_optimizer_in_backward; a parameter
    # given the attribute some other way has no handle to remove.
    module = sys.modules.get(_TORCH_MODULE)
    handles = getattr(module, "param_to_optim_hook_handle_map", {})
    for i in found:
        for handle in handles.get(params[i], ()):
            handle.remove()
    return found
