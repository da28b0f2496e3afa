"""The stall timeout's value: how long a rank waits for its peers, from an argument, ``$FANFOLD_STALL_TIMEOUT`` or
300 s, checked once here for every reader (the collectives, and ``fanfold run --stall-timeout``, which sets the
variable for its workers). docs/stalls.md."""
from __future__ import annotations

import os
from datetime import timedelta

DEFAULT_STALL_TIMEOUT = 300.0
ENV_VAR = "FANFOLD_STALL_TIMEOUT"
# The least stall timeout taken. A diagnosis reads its peers' progress records, which lag their progress by up to
# the inspector's write interval (0.05 s), and waits two intervals before it reads them: under 0.1 s it would name
# as missing a peer that had arrived but not yet published, and a shared-memory segment's set-up could time out
# before any peer had a chance to attach (an error that names no rank).
MIN_STALL_TIMEOUT = 0.1


def resolve_stall_timeout(timeout: float | timedelta | None = None, source: str = "stall_timeout") -> float:
    """Seconds to wait for a collective: ``timeout`` if given, else ``$FANFOLD_STALL_TIMEOUT``, else 300. A
    ValueError naming the value, the minimum and ``source`` (the argument's name) for what is not a number of
    seconds of at least ``MIN_STALL_TIMEOUT``."""
    if timeout is None:
        timeout, source = os.environ.get(ENV_VAR) or DEFAULT_STALL_TIMEOUT, ENV_VAR
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of seconds, got {timeout!r}") from None
    if not seconds > 0:
        raise ValueError(f"{source} must be positive, got {timeout!r}")
    if not seconds >= MIN_STALL_TIMEOUT:
        raise ValueError(f"{source} must be at least {MIN_STALL_TIMEOUT:g} s (the least wait in which a stall can "
                         f"be diagnosed: peers publish their progress every 0.05 s), got {timeout!r}")
    return seconds
