"""Collectives through one shared-memory segment for the ranks of one host: ``segment`` maps it and bounds every wait,
``engine`` runs the two algorithms (the ring through its slots, the peer reads), ``transport`` chooses between them.
"""
