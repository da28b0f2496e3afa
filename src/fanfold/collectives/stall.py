"""The stall inspector: ``InspectedTransport(inner)`` numbers, publishes, bounds and profiles every collective of
``inner``; a wait past the timeout raises :class:`StallError` naming the feature, the collective and the ranks that
never arrived, and raises the group's alarm. Design: docs/reliability.md, docs/stalls.md.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .protocol import StallError, Transport, TransportOwner
from .shm.engine import ShmMismatchError
from .shm.transport import ShmTransport
from .timeouts import ENV_VAR, bound, group_namespace, group_timeout, resolve_stall_timeout
from .transport import TorchTransport

__all__ = ["StallError", "InspectedTransport", "Publisher", "inspected", "for_feature", "group_transport",
           "caller_line", "read_progress", "WRITE_INTERVAL_S"]

WRITE_INTERVAL_S = 0.05  # the least time between two writes of a rank's record, unless flushed
ALARM_POLL_S = 0.5  # how often an idle writer looks for the group's alarm
CLOSE_WAIT_S = 5.0  # how long closing waits for the writer's store call in flight (a store call is not cancellable)
# How long a diagnosis waits for the store: over a link that went down a store call blocks in TCP's retransmissions,
# far past the store's own timeout; the diagnosis must end regardless. Not shorter: a store starved of CPU on a busy
# host took over 3 s to answer, and its peers' progress then read as unknown.
STORE_ANSWER_S = 5.0
_MAX_PENDING = 64
_BARRIER_SLICE_S = 0.5  # the inspector's barrier looks for the group's alarm this often
_HINT = (
    "Every rank must issue the same collectives in the same order: the same number of steps, each with one "
    "forward and one backward (DDP.join() handles uneven inputs, no_sync() accumulation). "
    f"The timeout is the stall_timeout argument or {ENV_VAR} (seconds)."
)

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
    """Writes the newest record ``post``-ed to it under ``key`` of ``store`` from a daemon thread, at most once per
    ``WRITE_INTERVAL_S`` unless flushed; ``alarm`` (key, callback): while idle it looks for that key every
    ``ALARM_POLL_S`` and calls the callback once with its JSON value."""

    def __init__(self, store: dist.Store, key: str, alarm: tuple[str, Callable[[dict], None]] | None = None):
        self._cond = threading.Condition()
        self._latest: dict | None = None
        self._busy = self._closed = self._urgent = False
        self._calling: float | None = None  # when the writer's store call in flight began (time.monotonic())
        # Its own connection: a store client serves one request at a time, and the training thread may sit in a
        # long store wait (a barrier) during which the record must still get through.
        self._thread = threading.Thread(target=self._run, args=(store.clone(), key, alarm), daemon=True,
                                        name=f"fanfold-stall-{key}")
        self._thread.start()

    def post(self, record: dict) -> None:
        with self._cond:
            # Wake the writer only when it waits for a record: while it waits out the interval, a wake-up per
            # collective (two context switches on a busy host) would cost more than the collective's bookkeeping.
            idle = self._latest is None
            self._latest = record
            if idle:
                self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Whether the latest record is written (or the writer closed) within ``timeout``."""
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._closed or (self._latest is None and not self._busy), timeout)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop the writer and wait (at most ``timeout``) for a store call it is in to return: a daemon thread that
        returns from C++ into an interpreter already finalizing ends the process with std::terminate (SIGABRT). A
        call that has not returned within ``STORE_ANSWER_S`` is not waited for any longer: the store is frozen or
        out of reach, and every rank's exit is bounded (docs/reliability.md); its thread ends with the process."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is self._thread:
            return
        end = time.monotonic() + timeout
        while self._thread.is_alive():
            now, began = time.monotonic(), self._calling
            if now >= end or (began is not None and now - began >= STORE_ANSWER_S):
                return
            self._thread.join(min(0.05, end - now))

    def _run(self, store: dist.Store, key: str, alarm: tuple[str, Callable[[dict], None]] | None) -> None:
        written = -WRITE_INTERVAL_S
        while True:
            with self._cond:
                while not self._cond.wait_for(lambda: self._closed or self._latest is not None,
                                              None if alarm is None else ALARM_POLL_S):
                    self._cond.release()  # no lock held across a store round trip
                    alarm_key, heard = alarm
                    self._calling = time.monotonic()
                    try:
                        if store.check([alarm_key]):
                            alarm = None
                            heard(json.loads(store.get(alarm_key)))
                    except Exception:  # the store is gone (the job is ending): no alarm can come any more
                        alarm = None
                    finally:
                        self._calling = None
                        self._cond.acquire()
                # the rest of the interval since the last write, unless a flush wants the record now
                self._cond.wait_for(lambda: self._closed or self._urgent,
                                    timeout=written + WRITE_INTERVAL_S - time.monotonic())
                if self._closed:
                    return
                record, self._latest, self._busy, self._urgent = self._latest, None, True, False
            self._calling = time.monotonic()
            try:
                store.set(key, json.dumps(record))
                written = time.monotonic()
            except Exception:  # the store is gone (its process died): nothing more can be published
                self.close()
            self._calling = None
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def _within(seconds: float, fn: Callable[[], object], otherwise: object) -> object:
    """``fn()``'s result, or ``otherwise`` when it raised or is still running after ``seconds`` (in a daemon thread:
    a store call cannot be cancelled)."""
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


def read_progress(store: dist.Store, rank: int) -> dict | str:
    """``rank``'s record, or why there is none."""
    try:
        if not store.check([str(rank)]):
            return "has not issued any fanfold collective"
        return json.loads(store.get(str(rank)))
    except Exception as exc:  # the store lives in rank 0's process (or the agent): it may be gone too
        return f"progress unknown, the store is unreachable ({type(exc).__name__}: {str(exc)[:120]})"


def _process_gone(pid: int, grace_until: float) -> bool:
    """Whether local process ``pid`` has exited, waiting for it until ``grace_until`` (time.monotonic())."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):  # a zombie has exited, unreaped
                    return True
        except OSError:  # no such process
            return True
        if time.monotonic() >= grace_until:
            return False
        time.sleep(0.05)


class _GaveUp(Exception):
    """A wait ran out of time or was ended by the group's alarm."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _missing_text(never: list[int], gave_up: list[int], unknown: list[int]) -> str:
    """Who the alarm's reader should look at, or why no rank can be named."""
    if never:
        return f"never arrived: {_ranks(never)}"
    if unknown:
        return f"none found missing: the progress of {_ranks(unknown)} is unknown (the store did not answer)"
    if gave_up:
        return f"none found missing: every rank arrived; {_ranks(gave_up)} gave up or died there"
    return "none found missing: every rank arrived (their connections failed)"


def _future_of(handle: Any) -> torch.futures.Future | None:
    if isinstance(handle, torch.futures.Future):
        return handle
    try:
        future = handle.get_future()
    except (AttributeError, RuntimeError):  # none, or a torch Work of a backend without futures
        return None
    return future if isinstance(future, torch.futures.Future) else None


def _is_timeout(exc: BaseException) -> bool:
    # gloo's, the store's and the shm transport's words for a wait that ran out of time
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "never arrived within" in text or (
        isinstance(exc, dist.DistStoreError) and "timeout" in text.lower())


def _disagreement(cause: BaseException | None) -> Any:
    """The shm transport's report of a peer in another collective (size, dtype, op) in ``cause``'s chain."""
    seen = 0
    while cause is not None and seen < 8:
        if isinstance(cause, ShmMismatchError):
            return cause
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None


class InspectedWork:
    """The handle of an inspected collective: ``wait()`` is bounded and diagnosed; the rest is the inner handle's."""

    def __init__(self, transport: InspectedTransport, op: Collective, handle: Any, timeout: float):
        self._transport, self._op, self._handle, self._timeout = transport, op, handle, timeout

    def wait(self, *args: Any, **kwargs: Any) -> Any:  # timeout arguments are ignored: the inspector's applies
        return self._transport._wait(self._op, self._handle, self._timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class InspectedTransport:
    """``inner`` (a ``collectives.Transport``) with numbered, published, bounded collectives: one numbering per
    instance. ``timeout`` in seconds (default ``$FANFOLD_STALL_TIMEOUT`` or 300, never above the group's timeout);
    ``group``, ``rank`` and ``world_size`` default to the inner transport's; ``store`` to the group's stall namespace;
    ``feature`` names the issuer in errors. ``barrier()`` goes through the store, bounded too (collectives still in
    flight are not waited for). The first rank to diagnose a stall raises the group's alarm (key ``alarm``): every
    rank's pending waits then end with a StallError, and ``inner.abort`` (if any) is called."""

    def __init__(self, inner: Transport, *, timeout: float | timedelta | None = None, group: Any = None,
                 store: dist.Store | None = None, rank: int | None = None, world_size: int | None = None,
                 feature: str | None = None):
        self.inner, self.feature = inner, feature
        group = group if group is not None else getattr(inner, "group", None)
        self.rank = inner.rank if rank is None else rank
        self.world_size = inner.world_size if world_size is None else world_size
        self._root = group_namespace(group, "stall") if store is None else store
        # Each rank counts its own transports in the store, so the n-th transport of every rank shares key space
        # n without any process-wide state, and two DDP models on one group do not mix their numbering.
        instance = self._root.add(f"instances/{self.rank}", 1)
        self.store = dist.PrefixStore(str(instance), self._root)
        self.base, self.limit = resolve_stall_timeout(timeout), group_timeout(group)
        abort = getattr(inner, "abort", None)  # the shm transport's: its peers' waits end at once
        self._on_alarm = abort if callable(abort) else None
        self.alarm: dict | None = None  # the group's alarm, once seen
        self._store_silent = False  # a diagnosis found the store not answering: later ones do not wait on it
        self._waiting: set[threading.Event] = set()  # the events of the waits in progress (the alarm sets them)
        self._seq = 0
        self._pending: list[Collective] = []  # started, not yet waited: a reducer has several buckets in flight
        self._state = {"pid": os.getpid(), "host": socket.gethostname(), "last": None, "pending": []}
        # The writer's thread looks for the alarm; it holds the transport weakly, so that the finalizer can run.
        heard = weakref.WeakMethod(self._heard)
        watch = ("alarm", lambda record: (m := heard()) is not None and m(record))
        self._publisher = Publisher(self._root, f"{instance}/{self.rank}", watch)  # self.store's key str(rank)
        weakref.finalize(self, self._publisher.close)

    @property
    def timeout(self) -> float:
        return bound(self.base, self.limit)

    def _start(self, kind: str, bucket: int | None = None) -> Collective:
        self._seq += 1
        op = Collective(self._seq, kind, bucket, caller_line())
        self._pending.append(op)
        del self._pending[:-_MAX_PENDING]  # handles dropped without a wait must not grow the record forever
        self._publish(last=op)
        return op

    def _complete(self, op: Collective) -> None:
        if op in self._pending:
            self._pending.remove(op)
            self._publish()

    def _wait(self, op: Collective, handle: Any, timeout: float) -> Any:
        """``handle``'s result within ``timeout`` and before the group's alarm (which sets the events in
        ``_waiting``), else a diagnosis. A handle without a future is bounded by its own transport."""
        try:
            # already done: the event costs more than the collective's bookkeeping
            future = None if isinstance(handle, dist.Work) and handle.is_completed() else _future_of(handle)
            if future is not None and not future.done():
                done = threading.Event()
                future.add_done_callback(lambda _: done.set())
                self._waiting.add(done)
                try:
                    if self.alarm is None:
                        done.wait(timeout)
                finally:
                    self._waiting.discard(done)
                if not future.done():
                    raise _GaveUp()
            result = handle.wait()
        except _GaveUp:
            raise self._diagnose(op, None, timeout) from None
        except Exception as exc:
            raise self._diagnose(op, exc, timeout) from exc
        self._complete(op)
        return result

    def _span(self, op: Collective) -> Any:
        if torch._C._autograd._profiler_enabled():  # a C call, far cheaper than entering record_function
            return record_function(f"fanfold.{op.kind.partition('(')[0]}")
        return nullcontext()

    def _run(self, kind: str, bucket: int | None, call: Callable[[], Any]) -> Any:
        """Start ``call()`` as collective ``kind``; under torch.profiler a span from the call to its completion."""
        op = self._start(kind, bucket)
        with self._span(op) as span:
            try:
                handle = call()
            except Exception as exc:
                raise self._diagnose(op, exc) from exc
            if handle is None or not hasattr(handle, "wait"):
                self._complete(op)  # it ran synchronously
                return handle
            future = None if span is None else _future_of(handle)
            if future is not None and not future.done():
                span._call_end_callbacks_on_future(future)  # the span ends when the collective does
            return InspectedWork(self, op, handle, self.timeout)

    def barrier(self) -> None:
        """Wait, at most ``timeout``, until every rank has reached its barrier of this number. Through the store: a
        synchronous barrier could not be bounded, and a small all-reduce meeting a rank one collective off would
        make gloo abort that rank's process ("Received data size doesn't match expected size") unannounced."""
        op = self._start("barrier")
        with self._span(op):
            self.flush()  # the peers must see this barrier in the record before they can give up on it
            key, timeout = f"barrier/{op.seq}", self.timeout
            deadline = time.monotonic() + timeout
            try:
                if self.store.add(key, 1) == self.world_size:
                    self.store.set(f"{key}/all", "1")
                # in slices, so that the group's alarm ends it too (a store wait cannot be interrupted)
                while not self.store.check([f"{key}/all"]):
                    left = deadline - time.monotonic()
                    if left <= 0.01 or self.alarm is not None:  # a store takes a wait under 1 ms as "no timeout"
                        raise _GaveUp()
                    try:
                        self.store.wait([f"{key}/all"], timedelta(seconds=min(left, _BARRIER_SLICE_S)))
                    except dist.DistStoreError as exc:
                        if not _is_timeout(exc):
                            raise
            except _GaveUp:
                raise self._diagnose(op, None, timeout) from None
            except Exception as exc:
                raise self._diagnose(op, exc, timeout) from None
            self._complete(op)

    def _publish(self, **fields: Any) -> None:
        self._state.update(fields, pending=list(self._pending))
        self._publisher.post(dict(self._state))

    def flush(self, timeout: float = 10.0) -> bool:
        """Return once this rank's latest progress is in the store (or the store is gone), or after ``timeout``:
        whether it is."""
        return self._publisher.flush(timeout)

    def _heard(self, record: dict) -> None:
        """The group's alarm (on the writer's thread): end this inspector's waits and the transport's."""
        if self.alarm is not None:
            return
        self.alarm = record
        for event in list(self._waiting):
            event.set()
        if self._on_alarm is not None:
            try:
                self._on_alarm(f"rank {record['rank']} diagnosed a stall: {record['headline']}")
            except Exception:  # noqa: BLE001 - the transport may be closed already: nothing left to end
                pass

    def _raise_alarm(self, headline: str) -> None:
        if self.alarm is not None:
            return
        record = {"rank": self.rank, "headline": headline}

        def tell() -> bool:
            if self._root.add("alarms", 1) == 1:  # the first rank's diagnosis is the one to tell
                self._root.set("alarm", json.dumps(record))
            return True

        # the store gone or out of reach: the peers learn of the stall from their own waits
        if _within(STORE_ANSWER_S, tell, False):
            self._heard(record)

    def _read_peers(self, answers: bool = True) -> dict[int, dict | str]:
        """Every peer's record; ``answers`` False: the store did not take this rank's own record in time, and is
        not asked again."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        got = _within(STORE_ANSWER_S, lambda: {r: read_progress(self.store, r) for r in peers}, None) if answers \
            else None
        if isinstance(got, dict):
            return got
        self._store_silent = True
        late = (f"progress unknown: the store did not answer within {STORE_ANSWER_S:g} s (its host unreachable, or "
                "a link down)")
        return {r: late for r in peers}

    def _diagnose(self, op: Collective, cause: BaseException | None, timeout: float | None = None) -> StallError:
        """Read every rank's progress and build the error for a wait on ``op`` that timed out, failed or was ended
        by the group's alarm, then raise the group's alarm."""
        timeout = self.timeout if timeout is None else timeout
        alarm = self.alarm
        self._publish(gave_up=op.seq)
        # Bounded (this, the reads, the alarm: STORE_ANSWER_S each), and once the store has not answered one of them
        # the others are not tried: a frozen store costs this diagnosis STORE_ANSWER_S once, not three times.
        answers = not self._store_silent and self.flush(STORE_ANSWER_S)
        # A peer whose connection just dropped is usually still exiting: give it up to a second to finish. And a peer's
        # record may lag its progress by up to WRITE_INTERVAL_S: a rank that fails at once (a dead peer, a mismatch)
        # waits that long, so that it does not report as behind a peer that arrived with it.
        grace_until = time.monotonic() + (1.0 if cause is not None else 0.0)
        time.sleep(2 * WRITE_INTERVAL_S)
        never, gave_up, disagreed, ahead, unknown, lines, dead = [], [], [], [], [], [], []
        notes: dict[int, str] = {}  # a rank that never arrived: where it is, in a few words (for the headline)
        for r, p in sorted(self._read_peers(answers).items()):
            if isinstance(p, str):
                lines.append(f"  rank {r}: {p}")
                (never if p.startswith("has not") else unknown).append(r)
                notes[r] = "no collective issued yet"
                continue
            last = Collective(*p["last"])
            pending = {o[0]: Collective(*o) for o in p["pending"]}
            gone = p["host"] == self._state["host"] and _process_gone(p["pid"], grace_until)
            quit_here = p.get("gave_up") == op.seq
            if op.seq in pending or quit_here:
                theirs = pending.get(op.seq)
                if theirs is None or (theirs.kind, theirs.bucket) == (op.kind, op.bucket):
                    what = "arrived"
                    if quit_here or gone:
                        gave_up.append(r)
                else:
                    what = f"in a different collective with the same number: {theirs}"
                    never.append(r)
                    notes[r] = f"in {theirs.kind} #{theirs.seq} instead"
            elif last.seq < op.seq:
                state = "still waiting on it" if last.seq in pending else "completed it"
                what = f"behind: its last collective is {last}, {state}"
                never.append(r)
                notes[r] = f"behind, at {last.kind} #{last.seq}"
            else:
                what = f"ahead: past #{op.seq}, its last collective is {last}"
                ahead.append(r)
            if "gave_up" in p:
                what += f"; it gave up waiting on #{p['gave_up']}"
            if gone:
                what += f"; its process {p['pid']} is gone"
                notes[r] = f"{notes[r]}; its process is gone" if r in notes else "its process is gone"
                dead.append(r)
            lines.append(f"  rank {r}: {what}")
        # a store that did not answer leaves the peers' progress unknown: the ranks the transport itself found
        # missing (a dead peer's process, a peer that never arrived) are named still
        named = [r for r in getattr(cause, "missing", None) or () if r in unknown]
        if named:
            unknown = [r for r in unknown if r not in named]
            never += named
            notes.update({r: "named by the transport; the store did not answer" for r in named})
        clash = _disagreement(cause)
        if clash is not None:  # the transport saw a peer in another size, dtype or op: that, not a wait, is the fault
            disagreed = [clash.peer]
            never = [r for r in never if r != clash.peer]
            gave_up = [r for r in gave_up if r != clash.peer]
            earlier = "" if clash.seq_text is None else f" in {clash.seq_text}"
            verdict = f"failed: rank {clash.peer} disagreed ({clash.field}){earlier}: {clash.detail}"
        elif alarm is not None:
            by = "this rank" if alarm["rank"] == self.rank else f"rank {alarm['rank']}"
            verdict = f"was ended: {by} had diagnosed a stall ({alarm['headline']})"
        elif cause is None or _is_timeout(cause):
            verdict = f"did not complete within {timeout:g} s"
        else:
            verdict = f"failed ({type(cause).__name__})"
        who = "" if self.feature is None else f"{self.feature}'s "
        found = " ".join(f"Ranks {what}: {ranks}." for what, ranks in (
            ("that never arrived", never), ("that disagreed", disagreed), ("that arrived and gave up", gave_up),
            ("already past it", ahead), ("whose progress is unknown", unknown)) if ranks)
        if not found:
            found = ("Every rank arrived: their connections failed (the cause below)." if cause is not None
                     else "Ranks that never arrived: none found.")
        headline = f"rank {self.rank} of {self.world_size}: {who}{op} {verdict}. {found}"
        parts = [headline, *lines]
        if cause is not None and clash is None:
            parts.append(f"  cause: {type(cause).__name__}: {str(cause)[:300]}")
        parts.append(_HINT)
        if alarm is None and not self._store_silent:  # a store that did not answer: the peers see the stall themselves
            self._raise_alarm(headline.partition(" started at ")[0] + f"; {_missing_text(never, gave_up, unknown)}")
        short = self._headline(op, timeout, cause, clash, alarm, never=never, notes=notes, gave_up=gave_up,
                               ahead=ahead, unknown=unknown)
        return StallError("\n".join(parts), rank=self.rank, seq=op.seq, kind=op.kind, bucket=op.bucket,
                          missing=sorted(never + disagreed + ahead), feature=self.feature, gone=dead,
                          headline=short)

    def _headline(self, op: Collective, timeout: float, cause: BaseException | None, clash: Any, alarm: dict | None,
                  *, never: list[int], notes: dict[int, str], gave_up: list[int], ahead: list[int],
                  unknown: list[int]) -> str:
        """The diagnosis in one line, for the top of a failed rank's report: what this rank was in, where the
        user's code started it, and who is missing, e.g. ``rank 0 of 2 stalled 5 s in DistributedDataParallel's
        all_reduce #7 (bucket 0) at train.py:20: rank 1 never arrived (behind, at all_reduce #6: did it skip a
        backward?)``."""
        if clash is not None:
            verb = "failed in"
        elif alarm is not None:
            verb = "gave up on"
        elif cause is None or _is_timeout(cause):
            verb = f"stalled {timeout:g} s in"
        else:
            verb = "failed in"
        who = "" if self.feature is None else f"{self.feature}'s "
        where = "" if op.bucket is None else f" (bucket {op.bucket})"
        path, _, rest = op.line.partition(":")  # "path:line in function"; the user's frame has the full path
        at = "" if op.line.startswith("<") else f" at {os.path.basename(path)}:{rest.partition(' ')[0]}"
        if clash is not None:
            blame = f"rank {clash.peer} disagreed ({clash.field}): {clash.detail}"
        elif alarm is not None:
            by = "this rank" if alarm["rank"] == self.rank else f"rank {alarm['rank']}"
            blame = f"{by} had diagnosed a stall ({alarm['headline']})"
        else:
            said = []
            for r in never:
                note = notes.get(r, "")
                # a live rank one collective behind in DDP's gradient all-reduce: the classic uneven backward
                if (self.feature == "DistributedDataParallel" and op.kind == "all_reduce"
                        and note.startswith("behind") and "gone" not in note):
                    note += ": did it skip a backward?"
                said.append(f"rank {r} never arrived" + (f" ({note})" if note else ""))
            said += [f"rank {r} is already past it" for r in ahead]
            said += [f"rank {r}'s progress is unknown" for r in unknown]
            if not said and gave_up:
                said.append(f"every rank arrived; {_ranks(gave_up)} gave up or died there")
            if not said:
                said.append("every rank arrived" + ("" if cause is None else
                                                    f"; their connection failed ({type(cause).__name__})"))
            blame = "; ".join(said)
        return f"rank {self.rank} of {self.world_size} {verb} {who}{op.kind} #{op.seq}{where}{at}: {blame}"

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> Any:
        return self._run("all_reduce", bucket, lambda: self.inner.all_reduce(tensor, bucket, divisor))

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True, compress: torch.dtype | None = None) -> Any:
        return self._run("all_reduce", bucket, lambda: self.inner.reduce_tensors(
            tensors, bucket, divisor=divisor, settle=settle, compress=compress))

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None) -> Any:
        return self._run("reduce_scatter", bucket, lambda: self.inner.reduce_scatter(
            tensor, out, bucket, divisor=divisor))

    def reduce_scatter_tensors(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, bucket: int | None = None,
                               *, divisor: float | None = None, settle: bool = True,
                               compress: torch.dtype | None = None) -> Any:
        return self._run("reduce_scatter", bucket, lambda: self.inner.reduce_scatter_tensors(
            tensors, out, bucket, divisor=divisor, settle=settle, compress=compress))

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> Any:
        return self._run("all_gather", bucket, lambda: self.inner.all_gather(tensor, out, bucket))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        return self._run(f"broadcast(src={src})", None, lambda: self.inner.broadcast(tensor, src))

    def all_reduce_now(self, tensor: torch.Tensor, bucket: int | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place, and return it once done: a small collective waited for at once
        (SyncBatchNorm's statistics) runs on this thread where the transport can (the shm transport's latency path)."""
        inner = self.inner
        if isinstance(inner, ShmTransport):
            self._run("all_reduce", bucket, lambda: inner.all_reduce(tensor, bucket, inline=True)).wait()
        else:
            self.all_reduce(tensor, bucket).wait()
        return tensor

    def on_group(self, group: Any) -> bool:
        """Whether these collectives travel over torch.distributed's ``group`` itself (None: the default group),
        where they would interleave with that group's other collectives."""
        world = dist.group.WORLD
        return isinstance(self.inner, TorchTransport) and (self.inner.group or world) is (group or world)


def inspected(transport: Transport, timeout: float | timedelta | None = None, feature: str | None = None
              ) -> InspectedTransport:
    """``transport`` wrapped in an :class:`InspectedTransport`, unless it already is one."""
    if isinstance(transport, InspectedTransport):
        return transport
    return InspectedTransport(transport, timeout=timeout, feature=feature)


def for_feature(transport: Transport, feature: str) -> InspectedTransport:
    """``transport``'s collectives numbered and published apart, their errors naming ``feature``: over its inner
    transport, with its stall timeout, when it is inspected already. Collective: every rank makes it in one order."""
    if isinstance(transport, InspectedTransport):
        return InspectedTransport(transport.inner, timeout=transport.base, feature=feature)
    return InspectedTransport(transport, feature=feature)


def group_transport(group: Any = None, feature: str | None = None) -> InspectedTransport:
    """The inspected transport for ``feature``'s collectives over process group ``group`` (None: the default group):
    the group's own where it has one (the ``fanfold`` backend's), else torch.distributed's. Made at the feature's
    first call on the group (every rank alike) and kept: one progress record and writer thread per feature."""
    pg = group if group is not None else dist.group.WORLD
    with _GROUP_LOCK:
        kept = _BY_GROUP.setdefault(pg, {})
        transport = kept.get(feature)
        if transport is None:
            inner = pg.shared_transport() if isinstance(pg, TransportOwner) else None
            transport = kept[feature] = InspectedTransport(inner or TorchTransport(group), group=group,
                                                           feature=feature)
        return transport


# The transports of group_transport, by process group: the default group's go with it; another group's transports
# hold the group, so they stay for the process (a handful: one per feature that used the group).
_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GROUP_LOCK = threading.Lock()
