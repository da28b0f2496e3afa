"""The walk over what crosses a stage boundary: a tensor, or nested tuples/lists of tensors (other leaves pass).

Used by ``partition`` (timing layers) and ``stage`` (leaves, copies, gradients). Its order of tensors is the one
contract between a sender's outputs and the gradients it receives back for them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["tensor_leaves", "map_tensors"]


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of an activation (a tensor or nested tuples/lists of them), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensor_leaves(x)]
    return []


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``, in the order of :func:`tensor_leaves`."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    return obj
