"""The one error of a collective that a peer did not complete: :class:`StallError`, with ``missing`` naming the ranks.

Every path raises it or a subclass (the shared-memory transport's ``ShmTimeoutError``, the stall inspector's
diagnosis, the barriers): a peer that never arrived, died, or gave up is told apart from a misuse of the API (a
``ValueError``/``TypeError``) by its type, and from the message by ``missing``.
"""
from __future__ import annotations

__all__ = ["StallError"]


class StallError(RuntimeError):
    """A collective did not complete: ``rank`` gave up on collective ``seq`` (``kind``) of ``feature`` (the fanfold
    feature that issued it, e.g. "clip_grad_norm_"); ``missing`` lists the ranks that never arrived (behind,
    elsewhere, or dead)."""

    def __init__(self, message: str, *, rank: int, seq: int, kind: str, bucket: int | None, missing: list[int],
                 feature: str | None = None):
        super().__init__(message)
        self.rank, self.seq, self.kind, self.bucket, self.missing = rank, seq, kind, bucket, missing
        self.feature = feature
