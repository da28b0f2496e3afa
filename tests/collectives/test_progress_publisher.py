"""The progress publisher writes a rank's newest record at most once per WRITE_INTERVAL_S (records posted meanwhile
collapse into the newest), and at once when flushed: a stall's diagnosis never reads a stale record. Closed, it waits
for the store call in flight: the process exits cleanly (the oracle: exit status 0 and silence)."""
import json
import subprocess
import sys
import threading
import time

import pytest

from fanfold.collectives import stall
from fanfold.collectives.stall import ALARM_POLL_S, WRITE_INTERVAL_S, Publisher


def _until(condition, seconds=30.0):
    """Whether ``condition()`` became true within ``seconds`` (the writer thread may wait long for a core)."""
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(condition())


class _CountingStore:
    """A store that records every write (and when), with clone() as the real ones have."""

    def __init__(self):
        self.writes: list[tuple[float, dict]] = []
        self.lock = threading.Lock()

    def clone(self):
        return self

    def set(self, key, value):
        with self.lock:
            self.writes.append((time.monotonic(), json.loads(value)))


def test_records_posted_in_a_burst_collapse_into_few_writes_of_the_newest():
    store = _CountingStore()
    pub = Publisher(store, "0")
    try:
        start = time.monotonic()
        for i in range(2000):  # a collective's start and end each post one: thousands a second in training
            pub.post({"seq": i})
        # the newest record always gets written (within a bound that allows for a loaded machine)
        assert _until(lambda: store.writes and store.writes[-1][1] == {"seq": 1999}), store.writes[-1:]
        elapsed = time.monotonic() - start
        with store.lock:
            writes = list(store.writes)
        assert len(writes) <= 2 + elapsed / WRITE_INTERVAL_S
        gaps = [b[0] - a[0] for a, b in zip(writes, writes[1:])]
        assert all(g >= 0.9 * WRITE_INTERVAL_S for g in gaps), gaps
    finally:
        pub.close()


def test_flush_writes_the_newest_record_at_once(monkeypatch):
    # an interval far longer than flush()'s own bound (10 s): a flush that waited it out would return unwritten
    monkeypatch.setattr(stall, "WRITE_INTERVAL_S", 600.0)
    store = _CountingStore()
    pub = Publisher(store, "0")
    try:
        pub.post({"seq": 1})
        pub.flush()
        pub.post({"seq": 2})  # within the interval of the first write: held back ...
        pub.flush()  # ... unless a reader needs it now
        with store.lock:
            assert [w[1]["seq"] for w in store.writes] == [1, 2]
    finally:
        pub.close()


def test_records_keep_their_key_and_the_alarm_is_heard_once_while_idle():
    class AlarmStore(_CountingStore):
        def __init__(self):
            super().__init__()
            self.keys, self.alarm, self.checks = [], None, 0

        def set(self, key, value):
            self.keys.append(key)
            super().set(key, value)

        def check(self, keys):
            self.checks += 1
            return self.alarm is not None

        def get(self, key):
            return self.alarm

    store, heard = AlarmStore(), []
    pub = Publisher(store, "3", alarm=("alarm", heard.append))
    try:
        assert _until(lambda: store.checks)  # idle: the writer has looked for the alarm (none yet)
        pub.post({"seq": 1})
        pub.flush()
        store.alarm = json.dumps({"rank": 1})
        assert _until(lambda: heard)
        checks = store.checks
        time.sleep(2 * ALARM_POLL_S)  # heard once: the writer looks no more
        pub.post({"seq": 2})
        pub.flush()
        assert store.keys == ["3", "3"] and heard == [{"rank": 1}] and store.checks == checks
    finally:
        pub.close()


# The writer sits in a C++ store call (a PrefixStore over a slow Python store) when the publisher is closed and the
# program ends; the call returns while the interpreter finalizes, which SIGSEGVs or SIGABRTs ("terminate called
# without an active exception") a thread still in C++, unless close() waited for it.
_EXIT_PROGRAM = """
import threading, time
import torch.distributed as dist
from fanfold.collectives.stall import Publisher

entered = threading.Event()


class SlowStore(dist.Store):
    def __init__(self):
        super().__init__()

    def clone(self):
        return self

    def check(self, keys):
        entered.set()
        time.sleep(0.2)
        return False

    def set(self, key, value):
        pass


junk = [[i] for i in range(2_000_000)]  # freed while the interpreter finalizes: the store call returns meanwhile
slow = SlowStore()  # torch holds only the C++ half
publisher = Publisher(dist.PrefixStore("p/", slow), "0", ("alarm", print))
assert entered.wait(120)
publisher.close()
"""


@pytest.mark.timeout(600)  # two interpreters importing torch: minutes on a loaded machine
def test_closing_waits_for_the_store_call_in_flight_so_the_process_exits_cleanly():
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _EXIT_PROGRAM], capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0 and not proc.stderr.strip(), (proc.returncode, proc.stderr[-2000:])
