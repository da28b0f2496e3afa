"""fanfold.distributed: one process per replica on torch.distributed process groups.

Layers: env (the torchrun contract) <- buckets <- reducer <- ddp; spawn starts local workers from Python.
"""
from .spawn import WorkerError, free_port, launch

__all__ = ["launch", "WorkerError", "free_port"]
