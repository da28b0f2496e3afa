"""How the process engine's workers are started and stopped: the start method (a forkserver that has imported torch,
or ``fork`` for a module whose class is defined in ``__main__``), the module's structure (a change restarts the
workers), and a bounded stop that also gives the caller its intra-op threads back.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from itertools import chain
from typing import Any

import torch
from torch import nn


def start_context(module: nn.Module) -> tuple[Any, bool]:
    """The multiprocessing context for ``module``'s workers, and whether it forks."""
    in_main = any(type(m).__module__ == "__main__" for m in module.modules())
    if in_main or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("fork"), True
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.multiprocessing", "fanfold"])
    return ctx, False


def structure(module: nn.Module) -> tuple[list, list[bool]]:
    """What the workers' copy of ``module`` depends on (compared at every forward), and every submodule's ``training``
    flag (sent at every forward): one walk over the dicts."""
    sig: list = []
    training = []
    for m in module.modules():
        sig.append(type(m))
        training.append(m.training)
        sig.extend((id(t), t.data_ptr(), t.shape, t.dtype, t.requires_grad)
                   for t in chain(m._parameters.values(), m._buffers.values()) if t is not None)
    return sig, training


def stop_workers(procs: list, mailboxes: list, caller_threads: int = 0, set_to: int = 0) -> None:
    """Ask the workers to stop, kill those that do not within seconds; give the caller ``caller_threads`` back if its
    count is still ``set_to`` (the one the engine set; the user may have set another since)."""
    for m in mailboxes:
        m.stop()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)
    if caller_threads > 0 and torch.get_num_threads() == set_to != caller_threads:
        torch.set_num_threads(caller_threads)
