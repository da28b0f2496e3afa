"""Assign parameters to gradient buckets: pure functions over sizes and (dtype, device) keys, no torch.distributed.

A bucket is a list of parameter indices reduced as one flat tensor of one dtype on one device; buckets are filled
in the order gradients are expected to become ready (a small first bucket, then ``bucket_cap_mb``, or torch's
``bucket_cap_mb_list``), and listed in launch order. The rules: docs/ddp.md, "Design notes".
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["MiB", "DEFAULT_CAP_MB", "FIRST_CAP_MB", "assign_buckets", "rebuild_order", "bucket_caps",
           "bucket_cap_list"]

MiB = 1024 * 1024
DEFAULT_CAP_MB = 25.0
FIRST_CAP_MB = 1.0


def bucket_caps(bucket_cap_mb: float | None = None, first_bucket_cap_mb: float | None = None) -> tuple[int, int]:
    """(first_cap_bytes, cap_bytes) from MiB figures; the first cap never exceeds the general one."""
    cap_mb = DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if not isinstance(cap_mb, (int, float)) or isinstance(cap_mb, bool) or not cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    first_mb = FIRST_CAP_MB if first_bucket_cap_mb is None else first_bucket_cap_mb
    if not isinstance(first_mb, (int, float)) or isinstance(first_mb, bool) or not first_mb > 0:
        raise ValueError(f"first_bucket_cap_mb must be a positive number of MiB, got {first_bucket_cap_mb!r}")
    cap = max(1, int(cap_mb * MiB))
    return min(max(1, int(first_mb * MiB)), cap), cap


def bucket_cap_list(bucket_cap_mb_list: Sequence[float]) -> list[int]:
    """torch's ``bucket_cap_mb_list`` (one cap in MiB per bucket) in bytes."""
    if isinstance(bucket_cap_mb_list, (str, bytes)) or not isinstance(bucket_cap_mb_list, Sequence) or \
            not bucket_cap_mb_list:
        raise ValueError(f"bucket_cap_mb_list must be a non-empty list of MiB figures, got {bucket_cap_mb_list!r}")
    for mb in bucket_cap_mb_list:
        if not isinstance(mb, (int, float)) or isinstance(mb, bool) or not mb > 0:
            raise ValueError(f"bucket_cap_mb_list must hold positive numbers of MiB, got {bucket_cap_mb_list!r}")
    return [max(1, int(mb * MiB)) for mb in bucket_cap_mb_list]


def assign_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    cap_bytes: int = int(DEFAULT_CAP_MB * MiB),
    first_cap_bytes: int = int(FIRST_CAP_MB * MiB),
    order: Sequence[int] | None = None,
    caps: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group parameter indices ``0..n-1`` into buckets.

    ``nbytes[i]`` is parameter i's gradient size in bytes, ``keys[i]`` its (dtype, device): buckets never mix keys.
    ``order`` is the expected gradient-ready order (default: reverse parameter order); each key's open bucket is
    closed once it reaches its cap (``first_cap_bytes`` for the first bucket of each key, ``cap_bytes`` after; or,
    given ``caps``, ``caps[k]`` for the k-th bucket of each key and the last one after the list).
    Returns the buckets in launch order (by the position in ``order`` of each bucket's first member); within a
    bucket, indices follow ``order``.
    """
    n = len(nbytes)
    if len(keys) != n:
        raise ValueError(f"nbytes has {n} entries but keys has {len(keys)}")
    if caps is not None:
        caps = list(caps)
        if not caps or min(caps) <= 0:
            raise ValueError(f"caps must be a non-empty list of positive byte counts, got {caps}")
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got cap_bytes={cap_bytes}, first_cap_bytes={first_cap_bytes}")
    order = list(range(n - 1, -1, -1)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}, got {order}")
    open_: dict[Hashable, tuple[list[int], int]] = {}  # key -> (indices, bytes) of the bucket being filled
    closed: dict[Hashable, int] = {}  # key -> number of its buckets closed so far
    done: list[list[int]] = []
    for i in order:
        if nbytes[i] < 0:
            raise ValueError(f"nbytes[{i}] is negative: {nbytes[i]}")
        members, size = open_.get(keys[i], ([], 0))
        members.append(i)
        size += nbytes[i]
        k = closed.get(keys[i], 0)
        cap = caps[min(k, len(caps) - 1)] if caps is not None else cap_bytes if k else first_cap_bytes
        if size >= cap:
            done.append(members)
            closed[keys[i]] = k + 1
            open_.pop(keys[i], None)
        else:
            open_[keys[i]] = (members, size)
    done.extend(members for members, _ in open_.values())
    position = {i: p for p, i in enumerate(order)}
    done.sort(key=lambda members: position[members[0]])
    return done


def rebuild_order(ready: Sequence[int], n: int) -> list[int]:
    """A full gradient-ready order from the indices observed ready in one backward (each at most once).

    Parameters that never became ready (unused in that step) go last, in reverse parameter order.
    """
    seen: set[int] = set()
    out: list[int] = []
    for i in ready:
        if not 0 <= i < n:
            raise ValueError(f"ready index {i} is outside 0..{n - 1}")
        if i in seen:
            raise ValueError(f"parameter {i} is listed twice in the ready order")
        seen.add(i)
        out.append(i)
    out.extend(i for i in range(n - 1, -1, -1) if i not in seen)
    return out
