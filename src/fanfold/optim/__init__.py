"""fanfold.optim: ``ZeroRedundancyOptimizer`` (ZeRO stages 1 and 2) and ``clip_grad_norm_`` over sharded
gradients."""
from .zero import ZeroRedundancyOptimizer, clip_grad_norm_

__all__ = ["ZeroRedundancyOptimizer", "clip_grad_norm_"]
