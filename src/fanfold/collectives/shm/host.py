"""Which processes share a host for the shared-memory transport: the same kernel (boot id) and the same /dev/shm."""
from __future__ import annotations

import os

from .segment import SHM_DIR

__all__ = ["host_key"]


def host_key() -> str:
    """Equal for two processes exactly when they run on one kernel and see the same /dev/shm mount."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return f"no-shm-{os.getpid()}-{id(object())}"  # never equal to another process's key
    return f"{boot}:{st.st_dev}:{st.st_ino}"
