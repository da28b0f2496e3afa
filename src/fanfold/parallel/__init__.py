"""fanfold.parallel: one process, several devices (CPU replicas included): DataParallel, its four verbs (scatter,
replicate, parallel_apply, gather) and the process engine. docs/data-parallel.md.
"""
from .data_parallel import DataParallel, data_parallel, unwrap
from .parallel_apply import WorkerPool, parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["scatter", "scatter_kwargs", "gather", "replicate", "parallel_apply", "WorkerPool", "data_parallel",
           "DataParallel", "unwrap"]
