"""fanfold.training: checkpoints, the resumable ``DistributedSampler`` and exact evaluation, the main job's worker."""
from . import data
from .checkpoint import CheckpointError, latest, load, save
from .data import DistributedSampler, gather_evaluation

__all__ = ["save", "load", "latest", "CheckpointError", "DistributedSampler", "gather_evaluation", "data"]
