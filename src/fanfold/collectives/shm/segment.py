"""The shared-memory segment of one ``ShmTransport`` (rank 0 creates it, every rank unlinks it once all have mapped
it): a header page (abort word and message), one line per rank (step counter, pid, current collective), the data.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import stat
import time
from datetime import timedelta
from typing import Any

from ..._core import shm
from ..protocol import StallError

__all__ = ["Segment", "ShmTimeoutError", "SegmentSpaceError", "SEGMENT_NAME", "segment_name", "leftover_segments",
           "host_key"]

_PREFIX = "fanfold-"
# fanfold-<pid namespace inode, or x>-<creator's pid>-<12 hex digits>: what segment_name() makes, nothing else
SEGMENT_NAME = re.compile(r"fanfold-(x|[0-9]{1,20})-([0-9]{1,10})-[0-9a-f]{12}")
_MAGIC = 0x464E464C  # "FNFL"
_LINE = 128  # one rank's line: two cache lines, so neighbours' writes never share one (adjacent-line prefetch)
_ABORT, _MSG, _MSG_LEN = 64, 128, 768
_ABORT_MISSING, _MISSING_RANKS = 72, 448  # the aborting rank's missing ranks, a bitmask up to _MSG
_NO_SPACE = "no space left in /dev/shm"
_RANKS = 1024


def host_key() -> str:
    """Equal for two processes exactly when they run on one kernel and see the same /dev/shm mount."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(shm.SHM_DIR)
    except OSError:
        return f"no-shm-{os.getpid()}-{id(object())}"  # never equal to another process's key
    return f"{boot}:{st.st_dev}:{st.st_ino}"


class ShmTimeoutError(StallError):
    """``rank`` waited in collective ``seq`` for the ranks ``missing``, which never arrived, died or gave up."""


class SegmentSpaceError(RuntimeError):
    """/dev/shm has no room for the segment (on every rank of the group)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"{_NO_SPACE} ({exc})"
    return f"{type(exc).__name__}: {exc}"


def leftover_segments() -> list[str]:
    """Names of fanfold segments in /dev/shm (normally none)."""
    try:
        return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(_PREFIX))
    except OSError:
        return []


def segment_name(pidns: str) -> str:
    return f"{_PREFIX}{pidns or 'x'}-{os.getpid()}-{secrets.token_hex(6)}"


def _from_store(value: bytes, key: str) -> str | None:
    # The store is the job's (authenticated under fanfold's launchers); still, a name is a path: use only names of
    # the form rank 0 makes, so a rewritten key can never point a rank at a file outside /dev/shm.
    name = value.decode(errors="replace")
    if not name:
        return None
    if not SEGMENT_NAME.fullmatch(name):
        raise ValueError(f"the store's key {key!r} holds {name!r}, which is not a fanfold segment name "
                         f"(fanfold-<pid namespace>-<pid>-<12 hex digits>): refused, nothing opened")
    return shm.check_name(name)


def _sweep(pidns: str) -> None:
    # A creator killed between creating and publishing a segment leaves its name behind; remove such names, but
    # only those of our pid namespace whose creator is gone (another namespace's pids mean nothing here), and only
    # regular files of our own user (as root, the sticky /dev/shm would let us remove anyone's).
    for name in leftover_segments():
        m = SEGMENT_NAME.fullmatch(name)
        if m is None or m.group(1) != pidns or shm.alive(int(m.group(2))):
            continue
        try:
            st = os.lstat(os.path.join(shm.SHM_DIR, name))
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                shm.unlink(name, shm.FileId(st.st_dev, st.st_ino))
        except OSError:
            pass


class Segment:
    """The mapped segment: ``data`` (``data_bytes`` of uint8), :meth:`arrive`, :meth:`wait_all`, :meth:`abort`.
    Collective: every rank constructs it with the same arguments."""

    def __init__(self, store: Any, rank: int, world_size: int, data_bytes: int, timeout: float, check_pids: bool):
        self._futex = shm.Futex("the shm transport")
        self.rank, self.world_size, self.timeout, self.check_pids = rank, world_size, timeout, check_pids
        self._data_offset = -(-(_RANKS + world_size * _LINE) // 4096) * 4096
        self._mm = self._map(store, self._data_offset + data_bytes)
        # Every tensor viewing the mapping (the engine's slots) holds it mapped: close() unmaps once none is left.
        self._bytes = shm.map_tensor(self._mm)
        self.base = self._bytes.data_ptr()
        self.data = self._bytes[self._data_offset:]
        self._counters = [ctypes.c_uint32.from_address(self._line(r)) for r in range(world_size)]
        self._abort = ctypes.c_uint32.from_address(self.base + _ABORT)
        self.arrived = 0  # the steps this rank has published (its counter, without the 32-bit wrap)

    def _line(self, r: int) -> int:
        return self.base + _RANKS + r * _LINE

    def _map(self, store: Any, size: int) -> Any:
        deadline = time.monotonic() + self.timeout
        name, error, mm, ident = None, "", None, None
        try:
            if self.rank == 0:
                try:
                    pidns = shm.pid_namespace()
                    _sweep(pidns)
                    name = segment_name(pidns)
                    mm, ident = shm.create_segment(name, size)
                    (ctypes.c_uint32 * 2).from_buffer(mm)[:] = (_MAGIC, self.world_size)
                finally:
                    store.set("name", name if mm is not None else "")  # "": the others stop waiting and report
            else:
                store.wait(["name"], timedelta(seconds=self.timeout))
                name = _from_store(store.get("name"), "name")
                if name is None:
                    raise RuntimeError("rank 0 could not create it")
                mm, ident = shm.open_segment(name, size)
                header = tuple((ctypes.c_uint32 * 2).from_buffer(mm))
                if header != (_MAGIC, self.world_size):
                    raise RuntimeError(f"{name} was made for another group (header {header})")
            ctypes.c_uint32.from_buffer(mm, _RANKS + self.rank * _LINE + 8).value = os.getpid()
        except Exception as exc:
            error, mm = _reason(exc), None
        finally:
            # Every rank reports, then every rank unlinks: after that the name is gone whatever happens next.
            try:
                store.set(f"attached/{self.rank}", error or "ok")
                self._wait_reports(store, deadline)
            finally:
                if ident is not None:  # only the file this rank mapped: never what a name came to point at
                    shm.unlink(name, ident)
        if error:
            raise RuntimeError(f"rank {self.rank} could not map the shm transport's segment: {error}")
        return mm

    def _wait_reports(self, store: Any, deadline: float) -> None:
        keys = [f"attached/{r}" for r in range(self.world_size)]
        while not store.check(keys):
            if time.monotonic() > deadline:
                late = [r for r, k in enumerate(keys) if not store.check([k])]
                if not late:  # every report came in since the look above: none is late
                    break
                raise ShmTimeoutError(
                    f"rank {self.rank}: ranks {late} did not attach to the shm transport's segment within "
                    f"{self.timeout:g} s", rank=self.rank, missing=late, seq=0, bucket=None, kind="shm")
            time.sleep(0.002)
        failed = {r: e for r, k in enumerate(keys) if (e := store.get(k).decode()) != "ok"}
        if any(e.startswith(_NO_SPACE) for e in failed.values()):
            raise SegmentSpaceError(f"rank {self.rank}: no room in {shm.SHM_DIR} for a shared-memory segment: {failed}")
        if failed:
            raise RuntimeError(f"rank {self.rank}: the shm transport's segment could not be mapped on ranks "
                               f"{sorted(failed)}: {failed}. Do all ranks share /dev/shm? Use FANFOLD_TRANSPORT=torch.")

    def line(self, r: int, fmt: type, offset: int) -> Any:
        # a ctypes view of rank ``r``'s line at byte ``offset`` (>= 16: the counter and the pid come first)
        return fmt.from_address(self._line(r) + offset)

    def pid(self, r: int) -> int:
        return ctypes.c_uint32.from_address(self._line(r) + 8).value

    def arrive(self) -> int:
        # publish this rank's next step (what it wrote is visible to whoever sees the count); the new count
        self.arrived += 1
        self._counters[self.rank].value = self.arrived & 0xFFFFFFFF
        self._futex.wake(self._line(self.rank))
        return self.arrived

    def wait_all(self, target: int, describe: Any) -> None:
        """Wait until every peer's count reached ``target``, at most ``timeout`` seconds (checking between sleeps
        the abort word and whether the peer lives); ``describe()`` gives (doing what, seq, bucket) for the error."""
        k = target & 0xFFFFFFFF
        deadline = time.monotonic() + self.timeout
        for p in range(self.world_size):
            c = self._counters[p]
            if p != self.rank and (c.value - k) & 0x80000000:
                self._futex.wait(c, k, lambda p=p: self._check(p, k, deadline, describe), yield_core=True)

    def _check(self, p: int, k: int, deadline: float, describe: Any) -> float:
        # between sleeps on peer p's counter: give up on an abort, the deadline or a dead peer; else sleep on
        if not (self._counters[p].value - k) & 0x80000000:
            # p arrived since the waiter looked: the step is complete, and every rank checks its headers (a peer
            # that found a mismatch there and aborted must not turn this rank's own mismatch error into a stall)
            return 0.0
        if self._abort.value:
            self._fail_aborted(describe, p, k)
        left = deadline - time.monotonic()
        if left <= 0:
            self._fail(describe, p, k, f" within {self.timeout:g} s, the timeout of every wait for a peer")
        if self.check_pids and not shm.alive(self.pid(p)):
            # only the dead are missing: a live peer behind this step is on its way
            dead = [q for q in self._behind(k) if not shm.alive(self.pid(q))] or [p]
            if self._abort.value:  # a survivor that gave up and left is dead too: its diagnosis names the victim
                self._fail_aborted(describe, p, k)
            gone = "; ".join(f"rank {q}'s process {self.pid(q)} is gone" for q in dead)
            self._fail(describe, p, k, f" ({gone})", dead, dead)
        return left

    def _behind(self, k: int) -> list[int]:
        return [q for q in range(self.world_size) if (self._counters[q].value - k) & 0x80000000]

    def _fail_aborted(self, describe: Any, p: int, k: int | None) -> None:
        # The peer that gave up first named whom it waited for: that is who is missing, here too (not the ranks
        # that gave up after it, which are alive); without a name, every rank behind this step.
        mask = int.from_bytes(ctypes.string_at(self.base + _ABORT_MISSING, _MISSING_RANKS // 8), "little")
        named = [q for q in range(min(self.world_size, _MISSING_RANKS)) if mask >> q & 1]
        message = ctypes.string_at(self.base + _MSG).decode(errors="replace")
        dead = [q for q in named if self.check_pids and not shm.alive(self.pid(q))]  # then a death's consequence
        self._fail(describe, p, k, f"; rank {self._abort.value - 1} gave up first: {message}", named or None, dead)

    def _fail(self, describe: Any, p: int, k: int | None, why: str, missing: list[int] | None = None,
              gone: list[int] | None = None) -> None:
        doing, seq, bucket = describe()
        if missing is None:
            missing = (self._behind(k) if k is not None else []) or [p]
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        raise ShmTimeoutError(
            f"fanfold shm transport: rank {self.rank} of {self.world_size} waited in {doing} for {who}, which never "
            f"arrived{why}", rank=self.rank, missing=missing, seq=seq, bucket=bucket, kind=doing.split(" of ", 1)[0],
            gone=gone)

    def peer_failed(self, p: int, describe: Any, exc: OSError) -> None:
        # a failed read of rank p's memory: ShmTimeoutError naming p where it died, the abort's, else RuntimeError
        pid = self.pid(p)
        settle = time.monotonic() + 1.0  # a killed process is gone (a zombie at least) within milliseconds
        while shm.alive(pid) and not self._abort.value and time.monotonic() < settle:
            time.sleep(0.005)
        if self._abort.value:  # p may be a survivor that gave up and left: the first to give up named the victim
            self._fail_aborted(describe, p, None)
        if not shm.alive(pid) or exc.errno == errno.ESRCH:
            doing, seq, bucket = describe()
            raise ShmTimeoutError(
                f"fanfold shm transport: rank {self.rank} of {self.world_size} could not read rank {p}'s memory in "
                f"{doing}: rank {p} died ({exc})", rank=self.rank, missing=[p], seq=seq, bucket=bucket,
                kind=doing.split(" of ", 1)[0], gone=[p]) from exc
        raise RuntimeError(f"fanfold shm transport: rank {self.rank} could not read rank {p}'s memory in "
                           f"{describe()[0]}: {exc}") from exc

    def abort(self, message: str, missing: list[int] | None = None) -> None:
        """Tell every peer that this rank gave up (their waits raise at once), with ``message`` and the ranks it found
        ``missing`` (the peers report the same ones)."""
        if self._abort.value:
            return  # the first abort's message is the useful one
        data = message.encode(errors="replace")[: _MSG_LEN - 1]
        ctypes.memmove(self.base + _MSG, data + b"\0", len(data) + 1)
        mask = 0
        for q in missing or ():
            if 0 <= q < min(self.world_size, _MISSING_RANKS):
                mask |= 1 << q
        ctypes.memmove(self.base + _ABORT_MISSING, mask.to_bytes(_MISSING_RANKS // 8, "little"), _MISSING_RANKS // 8)
        self._abort.value = self.rank + 1  # last: a peer that sees it sees the message and the ranks (x86's order)
        for r in range(self.world_size):
            self._futex.wake(self._line(r))

    def close(self) -> None:
        self._counters = []
        self.data = self._bytes = None
        self._abort = None
        mm, self._mm = getattr(self, "_mm", None), None
        shm.unmap(mm)
