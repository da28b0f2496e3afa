"""fanfold._core: the bottom layer. Device normalisation (``devices``), one walk over nested data (``tree``), the
wrapper prefixes (``prefixes``), bytes to a tensor and back without numpy (``buffers``), and shared memory between
processes with bounded futex waits (``shm``), each written once. Imports torch only."""
