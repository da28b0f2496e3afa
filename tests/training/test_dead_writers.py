"""``fanfold.save`` removes the temporary files that killed writers left for the same path, and never a live
writer's (issue 26: a SIGKILL during a save left tens of MB that nothing removed)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import fanfold

WRITER = r"""
import sys, time
from pathlib import Path
from fanfold.training.checkpoint import write_atomic

class Blocker:  # pickled inside the save, after the temporary file exists: the writer is caught mid-save
    def __reduce__(self):
        Path(sys.argv[2]).touch()
        time.sleep(120)
        return (int, ())

write_atomic(Path(sys.argv[1]), {"big": bytes(1 << 20), "block": Blocker()})
"""


def _writer_mid_save(tmp_path, target):
    marker = tmp_path / f"marker-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(marker)])
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, "the writer ended before it blocked"
        assert time.monotonic() < deadline, "the writer never reached the middle of its save"
        time.sleep(0.05)
    return proc


def _leftovers(target):
    return sorted(p.name for p in target.parent.glob(f".{target.name}.*.tmp"))


@pytest.mark.skipif(not os.path.exists("/proc/sys/kernel/random/boot_id"),
                    reason="no boot id: no writer is judged dead")
def test_a_killed_writers_file_is_removed_and_a_live_writers_kept(tmp_path):
    target = tmp_path / "ckpt.pt"
    live = _writer_mid_save(tmp_path, target)
    try:
        [live_file] = _leftovers(target)
        dead = _writer_mid_save(tmp_path, target)  # its own clean-up first: it must keep the live writer's file
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert len(_leftovers(target)) == 2
        fanfold.save(target, {"w": torch.arange(3.0)})
        assert _leftovers(target) == [live_file]  # the dead writer's file went, the live writer's stayed
        assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(3.0))
    finally:
        live.kill()
        live.wait(timeout=30)
