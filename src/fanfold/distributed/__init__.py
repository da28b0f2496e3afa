"""fanfold.distributed: one process per replica: ``DistributedDataParallel``, the torchrun contract (``env.py``), comm
hooks and join; re-exports the launcher's ``launch`` and the transports."""
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

__all__ = ["launch", "WorkerError", "free_port", "init_process_group", "destroy_process_group", "is_initialized",
           "rank", "world_size", "local_rank", "is_main_process", "barrier", "device", "DistributedDataParallel", "DDP",
           "TorchTransport", "ShmTransport", "HierarchicalTransport", "ShmTimeoutError", "select_transport",
           "StallError", "InspectedTransport", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]
