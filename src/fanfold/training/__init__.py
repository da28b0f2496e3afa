"""fanfold.training: the training essentials. Checkpoints (``checkpoint`` over ``safe_file``, ``keys`` and ``rng``),
the resumable ``DistributedSampler`` and exact evaluation (``data``), and the main job's worker (``job``).
May import every library layer below it; never the CLI.
"""
from . import data
from .checkpoint import CheckpointError, latest, load, save
from .data import DistributedSampler, gather_evaluation

__all__ = ["save", "load", "latest", "CheckpointError", "DistributedSampler", "gather_evaluation", "data"]
