"""Test helper: hosts simulated on one machine for the hierarchical collectives (a helper module, not a test file).

What makes two processes "different hosts" to fanfold is ``host_key()``: the kernel's boot id and the device and
inode of /dev/shm. Each rank here enters a mount namespace of its own (unshare(2) through ctypes, in the worker
before it uses /dev/shm) and bind-mounts its host's directory on /dev/shm: ranks of one simulated host share that
directory (so their shared memory meets), ranks of different ones do not. Root (CAP_SYS_ADMIN) is needed; the
network stays the machine's loopback (gloo across "hosts" runs over it).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

_CLONE_NEWNS = 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000


def cannot_simulate() -> str | None:
    """Why hosts cannot be simulated here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (a mount namespace per rank)"
    if shutil.which("unshare") is None:
        return "simulated hosts need util-linux's unshare to probe mount namespaces"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"mount namespaces are not available: {probe.stderr.strip()}"
    return None


def enter_host(directory: str) -> None:
    """Make ``directory`` this process's /dev/shm, in a mount namespace of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    # private first: the bind mount below must not propagate back to the machine's namespace
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(directory.encode(), b"/dev/shm", None, _MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount --bind {directory} /dev/shm")


def on_host(fn, directories: list[str], hosts: list[int], *args):
    """Run in a launched worker: enter the directory of host ``hosts[rank]`` (no namespace where ``directories`` is
    empty: one real host), then ``fn(*args)``."""
    if directories:
        enter_host(directories[hosts[int(os.environ["RANK"])]])
    return fn(*args)


@contextlib.contextmanager
def host_directories(count: int) -> Iterator[list[str]]:
    """``count`` empty directories on the machine's /dev/shm (tmpfs, as a host's /dev/shm is), removed afterwards;
    the caller checks they are left empty."""
    root = tempfile.mkdtemp(prefix="simhosts-", dir="/dev/shm")
    try:
        dirs = [os.path.join(root, f"host{h}") for h in range(count)]
        for d in dirs:
            os.mkdir(d)
        yield dirs
    finally:
        shutil.rmtree(root, ignore_errors=True)
