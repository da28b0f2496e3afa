"""Where this process sits, written once: is a torch.distributed group up, and which rank of how many is this.

Bottom layer: imports torch only. Every layer asks here instead of repeating ``dist.is_initialized()`` checks.
"""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

__all__ = ["is_initialized", "require_initialized", "rank_world"]


def is_initialized() -> bool:
    """True when the default torch.distributed process group is up."""
    return dist.is_available() and dist.is_initialized()


def require_initialized(who: str) -> None:
    """Raise the one error every fanfold object that needs a process group gives without one."""
    if not is_initialized():
        raise RuntimeError(f"{who} needs an initialised process group: call "
                           "fanfold.distributed.init_process_group() first (under `fanfold run` or fanfold.launch)")


def rank_world(group: Any = None, *, from_env: bool = True) -> tuple[int, int]:
    """(rank, world size) in ``group`` when a process group is up; otherwise ``$RANK``/``$WORLD_SIZE`` (a launched
    process before ``init_process_group``) when ``from_env``, else (0, 1): one process."""
    if is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if from_env:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return 0, 1
