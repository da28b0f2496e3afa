"""fanfold.optim: sharded optimizers. ``ZeroRedundancyOptimizer`` (state sharded in equal flat slices: ``layout``,
``shard_state``, ``zero``; stage 2 with DDP's sharded gradients: ``zero_stage2``) and ``clip_grad_norm_`` over
sharded gradients (``clip``).
May import ``fanfold.distributed``, ``fanfold.parallel``, ``fanfold.collectives`` and ``fanfold._core``; ``training``
(checkpoints) imports it.
"""
from .clip import clip_grad_norm_
from .zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "clip_grad_norm_"]
