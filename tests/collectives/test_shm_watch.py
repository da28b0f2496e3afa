"""The cleanup check of these tests (tests/_shm_watch.py) reports a segment left by a process of this test, killed
before it unlinked, and none of another job's: a live creator outside this process tree, a dead one, a name of
another pattern."""
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from _shm_watch import OwnSegments, descends_from
from fanfold._core.shm import SHM_DIR, pid_namespace

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this machine")

# a child that creates a segment as a transport's rank 0 does, says so, and waits to be killed
_CREATOR = """
import sys, time
from fanfold._core.shm import create_segment, pid_namespace
from fanfold.collectives.shm.segment import segment_name
name = segment_name(pid_namespace())
create_segment(name, 4096)
print(name, flush=True)
time.sleep(600)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(60)
    return p.pid


def test_a_killed_childs_segment_is_reported_and_other_jobs_are_not(tmp_path):
    ns = pid_namespace() or "x"
    foreign = [f"fanfold-{ns}-1-{secrets.token_hex(6)}",  # a live creator that is not this test's: pid 1
               f"fanfold-{ns}-{_dead_pid()}-{secrets.token_hex(6)}",  # a creator gone before the name appeared
               f"fanfold-someone-else-{secrets.token_hex(6)}"]
    made = []
    try:
        with OwnSegments() as segments:
            for name in foreign:
                open(os.path.join(SHM_DIR, name), "w").close()
                made.append(name)
            child = subprocess.Popen([sys.executable, "-c", _CREATOR], stdout=subprocess.PIPE, text=True)
            try:
                own = child.stdout.readline().strip()
                made.append(own)
                assert own and descends_from(child.pid, os.getpid())
                end = time.monotonic() + 60  # seen while its creator lives (the watcher's next look, however late)
                while own not in segments.ours and time.monotonic() < end:
                    time.sleep(segments.interval)
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait(60)
                child.stdout.close()
            assert segments.left(grace=0.5) == [own]
    finally:
        for name in made:
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
    assert not descends_from(1, os.getpid()) and descends_from(os.getpid(), os.getpid())
