"""The stall timeout's value: how long a rank waits for its peers, from an argument, ``$FANFOLD_STALL_TIMEOUT`` or
300 s, checked once here for every reader (the collectives, and ``fanfold run --stall-timeout``, which sets the
variable for its workers). docs/stalls.md."""
from __future__ import annotations

import os
from datetime import timedelta

DEFAULT_STALL_TIMEOUT = 300.0
ENV_VAR = "FANFOLD_STALL_TIMEOUT"


def resolve_stall_timeout(timeout: float | timedelta | None = None) -> float:
    """Seconds to wait for a collective: ``timeout`` if given, else ``$FANFOLD_STALL_TIMEOUT``, else 300."""
    source = "stall_timeout"
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
    return seconds
