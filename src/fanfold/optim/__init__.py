"""fanfold.optim: sharded optimizers. ``ZeroRedundancyOptimizer`` (``zero``: state sharded in equal flat slices laid
out by ``layout``; stage 2, the reducer's gradient strategy: ``sharded_grads`` and ``param_gather``) and
``clip_grad_norm_`` over sharded gradients (``clip``).
"""
from .clip import clip_grad_norm_
from .zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "clip_grad_norm_"]
