"""A rank's progress record for the stall inspector (``stall.py``): what it has started and still waits on.

One record per rank under one key of the process group's store: the last collective started, the ones still in
flight (number, kind, bucket, the user's source line), pid and host. A daemon thread writes it, so that the training
thread never waits on a store round trip (rank 0's process or the launcher's agent serves the store, and on a busy
host a write can take milliseconds), at most once per ``WRITE_INTERVAL_S`` (the newest record; those posted
meanwhile collapse into it) unless a reader needs it now (``flush``). A record matters only once a collective
stalls, seconds later, and writing one per collective cost fanfold DDP about a tenth of a small model's training
step on two cores: the store's server and the writing thread took CPU time from the ranks. A process killed within
``WRITE_INTERVAL_S`` of its newest record leaves an older one. The same thread, when idle, looks every
``ALARM_POLL_S`` for the group's alarm (a rank that diagnosed a stall, ``stall.py``), so that the other ranks' waits
end too (docs/stalls.md).
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Collective", "Publisher", "WRITE_INTERVAL_S", "ALARM_POLL_S", "caller_line", "read_progress",
           "process_gone"]

WRITE_INTERVAL_S = 0.05  # the least time between two writes of a rank's record, unless flushed
ALARM_POLL_S = 0.5  # how often an idle writer looks for the group's alarm (a rank that diagnosed a stall)

# Frames in these trees are plumbing; the line worth showing is the first one outside them (the user's).
_PLUMBING = tuple(
    os.path.dirname(p) + os.sep
    for p in (os.path.dirname(os.path.abspath(__file__)), os.path.abspath(torch.__file__))
) + (sysconfig.get_paths()["stdlib"] + os.sep,)


class Collective(NamedTuple):  # a tuple, so that it is published as a JSON list
    seq: int
    kind: str
    bucket: int | None
    line: str

    def __str__(self) -> str:
        where = "" if self.bucket is None else f" (bucket {self.bucket})"
        return f"{self.kind} #{self.seq}{where} started at {self.line}"


def caller_line() -> str:
    """``path:line in function`` of the innermost frame outside fanfold, torch and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_PLUMBING) and not path.startswith("<"):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<no user frame>"  # e.g. a hook run on an autograd device thread


class Publisher:
    """Writes the newest record ``post``-ed to it under ``key`` of ``store``, from a daemon thread. With ``alarm``
    (a key of ``store`` and a callback), the same thread, when idle, looks for that key every ``ALARM_POLL_S`` and
    calls the callback once with its JSON value when it appears: off the training thread, and no store round trip
    per collective."""

    def __init__(self, store: dist.Store, key: str, alarm: tuple[str, Callable[[dict], None]] | None = None):
        self._cond = threading.Condition()
        self._latest: dict | None = None
        self._busy = self._closed = self._urgent = False
        # Its own connection: a store client serves one request at a time, and the training thread may sit in a
        # long store wait (a barrier) during which the record must still get through.
        threading.Thread(target=self._run, args=(store.clone(), key, alarm), daemon=True,
                         name=f"fanfold-stall-{key}").start()

    def post(self, record: dict) -> None:
        with self._cond:
            # Wake the writer only when it waits for a record: while it waits out the interval, a wake-up per
            # collective (two context switches on a busy host) would cost more than the collective's bookkeeping.
            idle = self._latest is None
            self._latest = record
            if idle:
                self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> None:
        """Return once the newest record is written (or the store is gone)."""
        with self._cond:
            self._urgent = True  # no holding back for the interval
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._closed or (self._latest is None and not self._busy), timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self, store: dist.Store, key: str, alarm: tuple[str, Callable[[dict], None]] | None) -> None:
        written = -WRITE_INTERVAL_S
        while True:
            with self._cond:
                while not self._cond.wait_for(lambda: self._closed or self._latest is not None,
                                              None if alarm is None else ALARM_POLL_S):
                    self._cond.release()  # no lock held across a store round trip
                    try:
                        if _alarm_raised(store, *alarm):
                            alarm = None
                    finally:
                        self._cond.acquire()
                # the rest of the interval since the last write, unless a flush wants the record now
                self._cond.wait_for(lambda: self._closed or self._urgent,
                                    timeout=written + WRITE_INTERVAL_S - time.monotonic())
                if self._closed:
                    return
                record, self._latest, self._busy, self._urgent = self._latest, None, True, False
            try:
                store.set(key, json.dumps(record))
                written = time.monotonic()
            except Exception:  # the store is gone (its process died): nothing more can be published
                self.close()
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def _alarm_raised(store: dist.Store, key: str, callback: Callable[[dict], None]) -> bool:
    try:
        if not store.check([key]):
            return False
        record = json.loads(store.get(key))
    except Exception:  # the store is gone (the job is ending): no alarm can come any more
        return True
    callback(record)
    return True


# How long a diagnosis waits for the store: over a link that went down a store call blocks in TCP's retransmissions,
# far past the store's own timeout; the diagnosis must end regardless.
STORE_ANSWER_S = 3.0


def within(seconds: float, fn: Callable[[], object], otherwise: object) -> object:
    """``fn()``'s result, or ``otherwise`` when it has not returned within ``seconds`` (it goes on in a daemon
    thread: a store call cannot be cancelled) or raised."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - a failed call answers as one that never came
            pass

    t = threading.Thread(target=run, name="fanfold-store-call", daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else otherwise


def read_all_progress(store: dist.Store, ranks: list[int], seconds: float = STORE_ANSWER_S) -> dict[int, dict | str]:
    """Each of ``ranks``' records (:func:`read_progress`), all read within ``seconds``; a rank whose record did not
    come in time reads as unknown, saying why."""
    late = f"progress unknown: the store did not answer within {seconds:g} s (its host unreachable, or a link down)"
    got = within(seconds, lambda: {r: read_progress(store, r) for r in ranks}, None)
    return got if isinstance(got, dict) else {r: late for r in ranks}


def read_progress(store: dist.Store, rank: int) -> dict | str:
    """``rank``'s record, or why there is none."""
    try:
        if not store.check([str(rank)]):
            return "has not issued any fanfold collective"
        return json.loads(store.get(str(rank)))
    except Exception as exc:  # the store lives in rank 0's process (or the agent): it may be gone too
        return f"progress unknown, the store is unreachable ({type(exc).__name__}: {str(exc)[:120]})"


def process_gone(pid: int, grace_until: float = 0.0) -> bool:
    """Whether local process ``pid`` has exited, waiting for it until ``grace_until`` (time.monotonic())."""
    while not _exited(pid):
        if time.monotonic() >= grace_until:
            return False
        time.sleep(0.05)
    return True


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")  # a zombie has exited, unreaped
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False
