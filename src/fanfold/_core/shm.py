"""Shared memory between the processes of one host: named segments in /dev/shm (safe names only, never following or
reusing an entry), fd-backed buffers, bounded futex waits on 32-bit counters in them. Linux only (docs/shm.md).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SHM_DIR = "/dev/shm"
SPIN_S = 100e-6  # polling a word before sleeping in the kernel: the peer is usually that close
SLICE_S = 0.05  # seconds a sleep lasts at most, so that the caller's checks run between sleeps
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """``futex(2)`` on 32-bit counters in shared memory, through ``ctypes`` (which releases the interpreter lock);
    ``what`` names the feature in errors. One object per thread (its timespec)."""

    def __init__(self, what: str = "fanfold's shared memory"):
        if _SYS_FUTEX is None:
            raise RuntimeError(f"{what} needs Linux futexes; machine {platform.machine()!r} is not known")
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_long]
        self._call = fn
        self._timespec = _Timespec()
        self._ts = ctypes.addressof(self._timespec)

    def wake(self, address: int, count: int = 0x7FFFFFFF) -> None:
        self._call(_SYS_FUTEX, address, _FUTEX_WAKE, count, None, None, 0)

    def wait(self, word: Any, target: int, check: Callable[[], float | None], *, yield_core: bool,
             spin_s: float = SPIN_S) -> None:
        """Return once the counter ``word`` (a ``ctypes.c_uint32``) has reached ``target`` (modulo 2**32), polling it
        ``spin_s`` seconds before sleeping; ``check()`` runs before each sleep: it raises to give up, or returns the
        most seconds the sleep may last (None: 50 ms)."""
        k = target & 0xFFFFFFFF
        spin_end = time.perf_counter() + spin_s
        while (word.value - k) & 0x80000000:
            if time.perf_counter() > spin_end:
                break
            if yield_core:
                os.sched_yield()  # runnable threads (the computing one) get the core; otherwise returns at once
        address = ctypes.addressof(word)
        while True:
            seen = word.value
            if (seen - k) & 0x80000000 == 0:
                return
            most = check()
            s = SLICE_S if most is None else max(0.0, min(SLICE_S, most))
            self._timespec.tv_sec, self._timespec.tv_nsec = int(s), int((s % 1) * 1e9)
            self._call(_SYS_FUTEX, address, _FUTEX_WAIT, seen, self._ts, None, 0)


# One path component of letters, digits, '-', '_' and '.', not starting with '.', no "..": never a way out of
# /dev/shm, whatever the caller's own, stricter pattern.
_SAFE_NAME = re.compile(r"(?!.*\.\.)[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


def check_name(name: object, what: str = "segment name") -> str:
    """``name`` if it is a safe name of a file directly in /dev/shm, else ValueError naming ``what`` and the value."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r} is not a plain /dev/shm file name (letters, digits, '-', '_', '.'; no '/', "
                         f"no '..'): refused")
    return name


@dataclass(frozen=True)
class FileId:
    # which file a process created or opened: what unlink() compares the name with
    dev: int
    ino: int


def _checked_fd(fd: int, name: str, size: int | None) -> FileId:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RuntimeError(f"/dev/shm/{name} is not a regular file: refused")
    if st.st_uid != os.geteuid():
        raise RuntimeError(f"/dev/shm/{name} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}: "
                           f"refused (a segment of this job is made by this job's user)")
    if size is not None and st.st_size != size:
        raise RuntimeError(f"{name} has {st.st_size} bytes, this process expects {size}")
    return FileId(st.st_dev, st.st_ino)


def create_segment(name: str, size: int) -> tuple[mmap.mmap, FileId]:
    """Create and map ``/dev/shm/<name>`` of ``size`` bytes, mode 0600, its space reserved (a full /dev/shm is an
    error now, not a SIGBUS later). An existing entry is an error, never reused."""
    path = os.path.join(SHM_DIR, check_name(name))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits, but say exactly what the segment allows
        ident = _checked_fd(fd, name, None)
        try:
            os.posix_fallocate(fd, 0, size)
            return mmap.mmap(fd, size), ident
        except BaseException:
            unlink(name, ident)  # the file this call created (no room for it): a failed creation leaves nothing
            raise
    finally:
        os.close(fd)


def open_segment(name: str, size: int) -> tuple[mmap.mmap, FileId]:
    """Map the existing ``/dev/shm/<name>``: a regular file (not a link) of ``size`` bytes owned by this user."""
    path = os.path.join(SHM_DIR, check_name(name))
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        ident = _checked_fd(fd, name, size)
        return mmap.mmap(fd, size), ident
    finally:
        os.close(fd)


def unlink(name: str, owned: FileId) -> bool:
    """Remove ``/dev/shm/<name>`` if it is still the file ``owned``; whether it was removed. /dev/shm is sticky: once
    the name is seen to be ours, no other user can replace it first."""
    path = os.path.join(SHM_DIR, check_name(name))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (owned.dev, owned.ino) or not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def map_tensor(mm: mmap.mmap) -> torch.Tensor:
    # a uint8 tensor whose every view keeps the mapping (a memoryview's export, which unmap() respects; frombuffer
    # on the mmap itself holds none)
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8)


def unmap(mm: mmap.mmap | None) -> bool:
    """Unmap ``mm`` now (True), or, while a tensor from :func:`map_tensor` views it, when the last view dies."""
    try:
        if mm is not None:
            mm.close()
    except BufferError:
        return False
    return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but unreaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 tells whether the process exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def pid_namespace() -> str:
    """An id of this process's pid namespace ("" when unknown): pids are comparable only inside one."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        return ""


def shared_bytes(size: int) -> torch.Tensor:
    # fd-backed shared memory for a child process (nothing named in /dev/shm)
    return torch.empty(size, dtype=torch.uint8).share_memory_()
