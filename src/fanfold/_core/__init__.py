"""fanfold._core: the bottom layer, each piece written once. Devices (``devices``), the walk over nested data
(``tree``), the job's rank and authenticated store (``job``), shared memory with bounded futex waits (``shm``)."""
