"""fanfold.distributed: one process per replica on torch.distributed process groups.

Layers: env (the torchrun contract) <- buckets <- reducer (readiness, bucket_layout, bucket_paths, sparse, delayed)
<- ddp (ddp_options, mixed_precision, model_check); every collective of the reducer and of DDP goes through one
transport object (transport.py: torch.distributed; shm.py over shm_engine.py and shm_segment.py: shared
memory, chosen by shm_select.py), wrapped by the stall inspector (stall.py, progress.py); comm_hooks say how a bucket
is reduced, join.py how ranks with fewer batches shadow the others; spawn starts local workers from Python.
"""
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
from .spawn import WorkerError, free_port, launch
from .stall import InspectedTransport, StallError
from .shm import ShmTimeoutError, ShmTransport, select_transport
from .transport import TorchTransport

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
    "ShmTimeoutError",
    "select_transport",
    "StallError",
    "InspectedTransport",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
]
