"""fanfold: data parallelism for PyTorch. Fan the batch out over devices or processes, fold results and gradients back.
Public names only; the README's API table mirrors ``__all__``; the layers are declared in pyproject.toml."""
from . import pipeline
from .collectives.backend import FanfoldProcessGroup, register
from .collectives.stall import StallError
from .collectives.timeouts import stall_timeout
from .distributed.ddp import DDP, DistributedDataParallel
from .launcher import WorkerError, launch, launch_script
from .nn import SyncBatchNorm, revert_sync_batchnorm
from .optim import ZeroRedundancyOptimizer, clip_grad_norm_
from .parallel import DataParallel, WorkerPool, data_parallel, parallel_apply, replicate, unwrap
from .parallel.scatter_gather import gather, scatter, scatter_kwargs
from .pipeline import DistributedPipeline, Pipeline
from .training import CheckpointError, DistributedSampler, data, latest, load, save

__version__ = "0.1.0"

register()  # the one deliberate side effect of importing fanfold: init_process_group("fanfold") (idempotent)

__all__ = [
    "scatter", "scatter_kwargs", "gather", "replicate", "parallel_apply", "WorkerPool", "data_parallel", "DataParallel",
    "unwrap", "launch", "launch_script", "WorkerError", "DistributedDataParallel", "DDP", "StallError", "stall_timeout",
    "save", "load", "latest", "CheckpointError", "DistributedSampler", "data", "ZeroRedundancyOptimizer",
    "clip_grad_norm_", "Pipeline", "DistributedPipeline", "pipeline", "FanfoldProcessGroup", "SyncBatchNorm",
    "revert_sync_batchnorm",
]
