"""fanfold.nn: layers that need the whole batch -- SyncBatchNorm, over ranks and DataParallel replicas alike.

Layers (top imports lower only): syncbn (the module) <- functions (autograd) <- moments (what each part contributes);
group_sum (collectives over ranks, and DDP's join) and rendezvous (replicas in threads) beside; convert (BatchNorm to
SyncBatchNorm and back, below syncbn). Over fanfold.distributed (the join state); fanfold.parallel's DataParallel
links replicas through the ``link_replicas`` method, so nothing here imports it.
"""
from .syncbn import SyncBatchNorm, revert_sync_batchnorm

__all__ = ["SyncBatchNorm", "revert_sync_batchnorm"]
