"""fanfold.optim: ``ZeroRedundancyOptimizer`` (ZeRO stages 1 and 2) and ``clip_grad_norm_`` over sharded
gradients."""
from .clip import clip_grad_norm_
from .zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "clip_grad_norm_"]
