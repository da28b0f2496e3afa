"""Who creates a ``fanfold`` group: Accelerate's ``PartialState`` creates it, from
``InitProcessGroupKwargs(backend="fanfold")``, in a state it has already marked not distributed (on a machine
without an accelerator and without ``cpu=True``), and then trains every process's replica alone, never wrapped:
the replicas drift apart without an error. ``refuse_unwrapped(size)`` makes that a loud error at the group's
creation. Read from the caller's frames, not from an import: fanfold does not import Accelerate. docs/integrations.md.
"""
from __future__ import annotations

import os
import sys

_STATE = os.path.join("accelerate", "state.py")


def refuse_unwrapped(size: int) -> None:
    """RuntimeError where the group of ``size`` ranks is being created by an Accelerate state whose distributed type
    is NO (it will not wrap the model)."""
    if size < 2 or "accelerate" not in sys.modules:
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_STATE):
            state = frame.f_locals.get("self")
            kind = getattr(state, "distributed_type", None)
            if kind is not None and str(getattr(kind, "value", kind)) == "NO":
                raise RuntimeError(
                    f"fanfold backend: Accelerate is creating a group of {size} processes with distributed_type NO: "
                    "it would not wrap the model, and every process would train its own replica. On a CPU-only "
                    "machine call torch.distributed.init_process_group('fanfold') before Accelerator(cpu=True) "
                    "(docs/integrations.md)")
        frame = frame.f_back
