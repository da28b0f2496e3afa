"""fanfold.nn: SyncBatchNorm, over ranks and DataParallel replicas alike (docs/syncbn.md)."""
from .syncbn import SyncBatchNorm, revert_sync_batchnorm

__all__ = ["SyncBatchNorm", "revert_sync_batchnorm"]
