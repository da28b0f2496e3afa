"""Test helper: the fanfold segments in /dev/shm that this test's own processes made. Other jobs on the machine
(another test run, a training job) create and remove theirs at any time, and one of theirs may stay for minutes (a
rank waiting for its peers, a creator killed before it unlinked): a test's cleanup check looks only at its own."""
import os
import threading
import time

from fanfold._core.shm import pid_namespace
from fanfold.collectives.shm.segment import SEGMENT_NAME, leftover_segments


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants now (False once it is gone)."""
    for _ in range(256):  # a parent chain is short; a bound in case /proc changes under the walk
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


class OwnSegments:
    """While open, a thread lists /dev/shm every ``interval`` seconds; a fanfold segment name that was not there at
    the start is this test's when its creator (the pid in the name, in this pid namespace) is this process or a
    descendant of it when the name is first seen. A creator lives until every rank attached, far longer than
    ``interval``: a leftover of this test is seen while its creator still lives, even if it was killed later."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.before: set[str] = set()
        self.ours: set[str] = set()
        self._seen: set[str] = set()
        self._pidns = pid_namespace() or "x"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="own-shm-segments", daemon=True)

    def __enter__(self) -> "OwnSegments":
        self.before = set(leftover_segments())
        self._seen = set(self.before)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _look(self) -> None:
        for name in set(leftover_segments()) - self._seen:
            self._seen.add(name)
            m = SEGMENT_NAME.fullmatch(name)
            if m is not None and m.group(1) == self._pidns and descends_from(int(m.group(2)), os.getpid()):
                self.ours.add(name)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._look()

    def left(self, grace: float = 2.0) -> list[str]:
        """This test's segments still in /dev/shm; a name still being unlinked gets ``grace`` seconds."""
        self._look()
        deadline = time.monotonic() + grace
        while (left := self.ours & set(leftover_segments())) and time.monotonic() < deadline:
            time.sleep(0.05)
        return sorted(left)
