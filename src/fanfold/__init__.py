"""fanfold: data parallelism for PyTorch. Fan the batch out over devices or processes, fold results and gradients back.

Public names only; the README's API list mirrors ``__all__``.
"""
from .distributed.spawn import WorkerError, launch

__version__ = "0.1.0"

__all__ = [
    "launch",
    "WorkerError",
]
