"""fanfold.training: checkpoints (``checkpoint`` over ``safe_file``), the resumable ``DistributedSampler`` and exact
evaluation (``data``), and the main job's worker (``job``).
"""
from . import data
from .checkpoint import CheckpointError, latest, load, save
from .data import DistributedSampler, gather_evaluation

__all__ = ["save", "load", "latest", "CheckpointError", "DistributedSampler", "gather_evaluation", "data"]
