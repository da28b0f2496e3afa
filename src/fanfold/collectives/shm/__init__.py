"""fanfold.collectives.shm: collectives through one shared-memory segment for ranks on one host.

``segment`` (the mapped memory, bounded futex waits, cleanup) <- ``peer`` (reading peers' memory) <- ``engine``
(the algorithms) <- ``thread`` (the request thread and handles) <- ``transport`` (``ShmTransport``); ``host`` says
which processes share a host.
"""
