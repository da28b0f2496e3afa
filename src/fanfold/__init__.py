"""fanfold: data parallelism for PyTorch. Fan the batch out over devices or processes, fold results and gradients back.

Public names only; the README's API list mirrors ``__all__``.
"""
from .distributed.spawn import WorkerError, launch
from .distributed.ddp import DDP, DistributedDataParallel
from .distributed.stall import StallError
from .checkpoint import CheckpointError, latest, load, save
from . import data
from .scatter_gather import gather, scatter, scatter_kwargs
from .replicate import replicate
from .parallel_apply import WorkerPool, parallel_apply
from .data_parallel import DataParallel, data_parallel, unwrap
from .nn import SyncBatchNorm, revert_sync_batchnorm

__version__ = "0.1.0"

__all__ = [
    "scatter",
    "scatter_kwargs",
    "gather",
    "replicate",
    "parallel_apply",
    "WorkerPool",
    "data_parallel",
    "DataParallel",
    "unwrap",
    "launch",
    "WorkerError",
    "DistributedDataParallel",
    "DDP",
    "StallError",
    "save",
    "load",
    "latest",
    "CheckpointError",
    "data",
    "SyncBatchNorm",
    "revert_sync_batchnorm",
]
