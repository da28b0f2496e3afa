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


def _boot():
    return open("/proc/sys/kernel/random/boot_id").read().strip().replace("-", "")[:16]


@pytest.mark.skipif(not os.path.exists("/proc/sys/kernel/random/boot_id"),
                    reason="no boot id: no writer is judged dead")
def test_save_removes_no_file_or_link_it_did_not_create(tmp_path, monkeypatch):
    # A shared sticky directory, as /tmp: another user plants names the clean-up of dead writers' files would match,
    # and the name save's own temporary file would take first. save removes none of them and writes the checkpoint.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    target = shared / "ckpt.pt"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)  # a pid that no longer exists: a dead writer's, by the name
    stale = f".ckpt.pt.{_boot()}.{gone.pid}"
    canary = tmp_path / "canary"
    canary.write_bytes(b"precious")
    link = shared / f"{stale}.0000000a.tmp"
    link.symlink_to(canary)
    own = shared / f"{stale}.0000000c.tmp"  # the positive control: a dead writer's file of this user goes
    own.write_bytes(b"left by a killed save")
    planted = [link]
    if os.geteuid() == 0:  # root can make another user's files; others plant links only
        foreign = shared / f"{stale}.0000000b.tmp"
        foreign.write_bytes(b"another user's file")
        os.chown(foreign, 65534, 65534)
        os.lchown(link, 65534, 65534)
        squat = shared / f".ckpt.pt.{_boot()}.{os.getpid()}.deadbeef.tmp"  # where this save's first try goes
        squat.write_bytes(b"another user's file")
        os.chown(squat, 65534, 65534)
        planted += [foreign, squat]
        tokens = iter(["deadbeef"])
        real = fanfold.training.checkpoint.secrets.token_hex
        monkeypatch.setattr(fanfold.training.checkpoint.secrets, "token_hex", lambda n: next(tokens, None) or real(n))
    before = {p: (os.lstat(p).st_ino, os.lstat(p).st_uid) for p in planted}
    state = {"w": torch.arange(5.0), "step": 3}
    fanfold.save(target, state)
    assert {p: (os.lstat(p).st_ino, os.lstat(p).st_uid) for p in planted if os.path.lexists(p)} == before
    assert os.path.islink(link) and canary.read_bytes() == b"precious"
    assert not own.exists()
    loaded = torch.load(target, weights_only=True)  # torch's own reader as the oracle
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    plain = fanfold.load(target, {"w": None, "step": None})
    assert torch.equal(plain["w"], state["w"]) and plain["step"] == 3
