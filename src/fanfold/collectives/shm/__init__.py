"""fanfold.collectives.shm: collectives through one shared-memory segment for ranks on one host.

``segment`` (the mapped memory, bounded futex waits, cleanup) and ``request`` (a collective's description: the
request dataclasses and the header each rank publishes) <- ``peer`` (reading peers' memory) <- ``exchange``
(all_gather, reduce_scatter, all_to_all) <- ``engine`` (all_reduce, broadcast, barrier; runs them all) <- ``small``
(the latency path: a small all_reduce on the caller's thread) <- ``thread``
(the worker: its thread, the caller-thread path, the handles) <- ``transport`` (``ShmTransport``; its arguments
checked in ``tensors``); ``host`` says which processes share a host.
"""
