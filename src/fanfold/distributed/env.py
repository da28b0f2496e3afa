"""The torchrun environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): initialise and tear
down the process group, and ask where this process sits (rank 0 of 1 in a plain single process)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .._core.devices import accelerator_type
from .._core.job import install_env_rendezvous, is_initialized, rank_world
from ..collectives.stall import group_transport

__all__ = ["init_process_group", "destroy_process_group", "is_initialized", "rank", "world_size", "local_rank",
           "is_main_process", "barrier", "device"]


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def init_process_group(backend: str | None = None, timeout: timedelta | float = 600.0) -> torch.device:
    """Join the process group the torchrun environment describes; the local accelerator ``LOCAL_RANK`` becomes the
    current device, returned. ``backend``: "nccl" when CUDA is available, else "gloo"; ``timeout`` (seconds or a
    timedelta) bounds every collective. A job secret in the environment (``fanfold run`` and ``fanfold.launch`` set
    one) makes the group's store admit only the job's processes (``fanfold._core.job``)."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"fanfold.distributed.init_process_group: environment variables {missing} are not set. Start the script "
            "with `fanfold run -n N script.py` (or torchrun), or call the function through `fanfold.launch(fn, "
            "nprocs=N)`, which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.")
    if dist.is_initialized():
        raise RuntimeError("fanfold.distributed.init_process_group: the default process group is already initialised")
    if isinstance(timeout, (int, float)):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        timeout = timedelta(seconds=float(timeout))
    elif not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be seconds or a datetime.timedelta, got {type(timeout).__name__}")
    r, n, lr = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    if not 0 <= r < n:
        raise RuntimeError(f"RANK={r} is outside WORLD_SIZE={n}")
    acc = accelerator_type()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dev = torch.device("cpu")
    if acc is not None:
        count = torch.get_device_module(acc).device_count()
        if lr >= count:
            raise RuntimeError(f"LOCAL_RANK={lr} but this host has only {count} {acc} device(s): start at most "
                               f"{count} processes per node (`fanfold run -n {count}`)")
        dev = torch.device(acc, lr)
        torch.get_device_module(acc).set_device(dev)
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    install_env_rendezvous()  # the job's authenticated store where the environment holds its secret
    dist.init_process_group(backend, rank=r, world_size=n, timeout=timeout, **kwargs)
    return dev


def destroy_process_group() -> None:
    """Leave the default process group; a no-op when none is initialised."""
    if is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """Global rank: from the process group, else $RANK, else 0."""
    return rank_world()[0]


def world_size() -> int:
    """Number of processes: from the process group, else $WORLD_SIZE, else 1."""
    return rank_world()[1]


def local_rank() -> int:
    """Rank on this host: $LOCAL_RANK, else 0."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    """True on global rank 0 (and in a single process): the one that logs and saves."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank; a no-op in a single process. Bounded by ``$FANFOLD_STALL_TIMEOUT`` (else the process
    group's timeout): a rank that does not come makes the others raise :class:`~fanfold.StallError` naming it."""
    if is_initialized() and dist.get_world_size() > 1:
        # First through the store, numbered and diagnosed (torch's barrier would time out naming nobody), then
        # torch's own, which every rank reaches at once and which waits for the collectives still in flight.
        group_transport(None, feature="fanfold.distributed.barrier").barrier()
        dist.barrier()


def device() -> torch.device:
    """This process's device: the local-rank accelerator when one is available, else the CPU."""
    acc = accelerator_type()
    return torch.device("cpu") if acc is None else torch.device(acc, local_rank())
