"""fanfold.collectives.shm: collectives through one shared-memory segment for ranks on one host, by two algorithms:
the ring through the segment's slots, and direct reads of the peers' tensors where the kernel allows them.

``segment`` (the mapped memory on ``_core.shm``, bounded waits, which processes share a host) and ``request`` (a
collective's description, the checked flat views of its tensors, the header each rank publishes) <- ``peer`` (the
peer reads) <- ``engine`` (the ring; runs every collective) <- ``thread`` (the worker thread, the caller-thread
path, the handles) <- ``exchanges`` (all_gather, reduce_scatter, all_to_all) <- ``transport`` (``ShmTransport`` and
the one rule that picks the algorithm).
"""
