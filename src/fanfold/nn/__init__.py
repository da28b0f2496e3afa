"""fanfold.nn: layers that need the whole batch -- SyncBatchNorm, over ranks and DataParallel replicas alike.

DataParallel links replicas through each module's ``link_replicas`` method, so nothing here imports
``fanfold.parallel``. Modules and design notes: docs/syncbn.md.
"""
from .syncbn import SyncBatchNorm, revert_sync_batchnorm

__all__ = ["SyncBatchNorm", "revert_sync_batchnorm"]
