"""Submodules with collectives of their own (``fanfold.SyncBatchNorm``) and the two hooks DDP calls on them.

Layer: ``fanfold.distributed``, beside ``ddp.py`` (which calls the hooks) and ``join.py`` (the state it hands over);
implemented above, in ``fanfold.nn``, so nothing here imports the modules that take part.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .join import JoinState

__all__ = ["DDPParticipant"]


@runtime_checkable
class DDPParticipant(Protocol):
    """A submodule whose forward or backward issues collectives of its own."""

    def use_transport(self, transport: Any, process_group: Any) -> None:
        """At ``DistributedDataParallel`` construction: DDP's transport (the stall inspector over shared memory or
        torch.distributed) and the process group it spans (None: the default group). A participant on the same
        group may issue its collectives there, in step with DDP's own."""

    def set_join_state(self, state: JoinState | None) -> None:
        """``DistributedDataParallel.join()`` on entry (the state; may raise to refuse) and on exit (None)."""
