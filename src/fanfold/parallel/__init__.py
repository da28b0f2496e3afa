"""fanfold.parallel: one process, several devices (CPU replicas included).

``comm`` (broadcast, scatter, gather, reduce-add between devices) <- ``functions`` (their autograd duals) <-
``scatter_gather`` (nested inputs) and ``replicate`` <- ``parallel_apply`` (the replicas' forward on a persistent
pool) <- ``parallel_backward`` (their backward, concurrently) <- ``process_slots`` (shared-memory slots) <-
``process_mailbox`` (messages, futex hand-offs) <- ``process_worker`` <- ``process_remote`` / ``process_start`` <-
``process_engine`` (replica 0 in the caller, the others in worker processes, ``engine="process"``) <-
``data_parallel`` (the four verbs composed).
May import ``fanfold._core`` and ``fanfold.collectives``; never ``distributed``, ``training`` or the CLI.
"""
from .data_parallel import DataParallel, data_parallel, unwrap
from .parallel_apply import WorkerPool, parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["scatter", "scatter_kwargs", "gather", "replicate", "parallel_apply", "WorkerPool", "data_parallel",
           "DataParallel", "unwrap"]
