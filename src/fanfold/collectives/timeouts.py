"""How long a rank waits for its peers: one setting shared by every collective layer.

``resolve_stall_timeout`` reads the ``stall_timeout`` argument, else ``$FANFOLD_STALL_TIMEOUT``, else 300 s. The
shared-memory transport bounds its waits by it and the stall inspector (``stall.py``) reports a
collective as stalled after it.
"""
from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["resolve_stall_timeout", "DEFAULT_STALL_TIMEOUT", "ENV_VAR"]

DEFAULT_STALL_TIMEOUT = 300.0
ENV_VAR = "FANFOLD_STALL_TIMEOUT"


def resolve_stall_timeout(timeout: float | timedelta | None = None) -> float:
    """Seconds to wait for a collective: ``timeout`` if given, else ``$FANFOLD_STALL_TIMEOUT``, else 300."""
    source = "stall_timeout"
    if timeout is None:
        timeout, source = os.environ.get(ENV_VAR, DEFAULT_STALL_TIMEOUT), ENV_VAR
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of seconds, got {timeout!r}") from None
    if not seconds > 0:
        raise ValueError(f"{source} must be positive, got {timeout!r}")
    return seconds
