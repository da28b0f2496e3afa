"""fanfold.distributed: one process per replica on torch.distributed process groups.

Inside: env (the torchrun contract) <- buckets <- reducer (readiness, bucket_layout, bucket_paths, sparse, delayed)
<- ddp (ddp_options, mixed_precision, model_check); every collective of the reducer and of DDP goes through one
transport object of ``fanfold.collectives`` (torch.distributed, shared memory, or both: hierarchical), wrapped by
its stall inspector (``collectives/stall.py``); comm_hooks say how a bucket is reduced, join.py how ranks with
fewer batches shadow the others. Re-exports the launcher's ``launch`` and the transports for convenience.
May import ``fanfold._core``, ``fanfold.collectives`` and ``fanfold.launcher``; never ``parallel``, ``training`` or
the CLI.
"""
from ..collectives import HierarchicalTransport, ShmTimeoutError, ShmTransport, TorchTransport, select_transport
from ..collectives.stall import InspectedTransport, StallError
from ..launcher.spawn import WorkerError, free_port, launch
from .comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .ddp import DDP, DistributedDataParallel
from .env import (
    barrier,
    destroy_process_group,
    device,
    init_process_group,
    is_initialized,
    is_main_process,
    local_rank,
    rank,
    world_size,
)

__all__ = [
    "launch",
    "WorkerError",
    "free_port",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "is_main_process",
    "barrier",
    "device",
    "DistributedDataParallel",
    "DDP",
    "TorchTransport",
    "ShmTransport",
    "HierarchicalTransport",
    "ShmTimeoutError",
    "select_transport",
    "StallError",
    "InspectedTransport",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
]
