"""fanfold.collectives.shm: collectives through one shared-memory segment for ranks on one host, by two algorithms:
the ring through the segment's slots (``engine``) and direct reads of the peers' tensors (``peer``), chosen in
``transport``; ``segment`` maps the memory and bounds every wait.
"""
