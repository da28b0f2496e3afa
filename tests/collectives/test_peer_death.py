"""A peer that dies while the others read its memory (the shm transport's peer reads, ``process_vm_readv``): every
survivor raises the one error of a dead peer, :class:`fanfold.StallError` (here its subclass ``ShmTimeoutError``),
with ``missing`` naming the dead rank and nothing else, within the stall timeout -- never a bare RuntimeError of
the system call. Three ranks: one dies, two survive, so a survivor that hears of the death from the other (the
abort word) must still name the dead rank, not the one that gave up first."""
import os
import pickle
import random
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _survivors import run_surviving

import fanfold
from fanfold._core.shm import alive
from fanfold.collectives.shm.transport import ShmTimeoutError, ShmTransport

NPROCS, TIMEOUT = 3, 2.0
CHUNK = 64 << 10  # small chunks: a collective makes many reads of every peer


def _tensors(r):
    g = torch.Generator().manual_seed(r)
    return [torch.randn(n, generator=g) for n in (70001, 150000, 3)]


def _report(path, r, result):
    with open(f"{path}.{r}", "wb") as f:
        pickle.dump(result, f)


def _transport(path):
    """This rank and a shm transport that reads its peers' memory, or None (reported as a skip) where it may not."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    r = dist.get_rank()
    t = ShmTransport(timeout=TIMEOUT, chunk_bytes=CHUNK)
    if not t.peer_read:
        _report(path, r, {"skip": "the ranks may not read each other's memory here"})
        return r, None
    return r, t


def _outcome(exc):
    stall = isinstance(exc, fanfold.StallError)
    return {"type": type(exc).__name__, "shm": isinstance(exc, ShmTimeoutError), "stall": stall,
            "missing": exc.missing if stall else None, "message": str(exc), "at": time.time()}


def _stream(path, seed):
    """All-reduces of private tensors (peer reads) until one fails; one rank kills itself at a random moment."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    r = dist.get_rank()
    rng = random.Random(seed)
    victim, delay = rng.randrange(NPROCS), rng.uniform(0.0, 0.4)
    t = ShmTransport(timeout=TIMEOUT, chunk_bytes=CHUNK)
    if not t.peer_read:
        _report(path, r, {"skip": "the ranks may not read each other's memory here"})
        return
    xs = _tensors(r)
    t.reduce_tensors(xs).wait()  # one good collective: the peer dies mid-training, not at start
    if r == victim:
        _report(path, r, {"victim": True, "dies": time.time() + delay})
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    result = {"completed": 0}
    try:
        for i in range(100000):
            t.reduce_tensors(xs, settle=i % 2 == 0).wait()  # settled and not: both step patterns
            result["completed"] += 1
            if r == victim:
                time.sleep(0)
    except Exception as exc:  # noqa: BLE001 - the test asserts the type
        result.update(_outcome(exc))
    if r != victim:
        _report(path, r, result)


def _survivors(path, codes):
    files = [pickle.load(open(f"{path}.{r}", "rb")) for r in range(NPROCS)]
    if any("skip" in f for f in files):
        pytest.skip(files[0].get("skip") or files[1].get("skip"))
    (victim,) = [r for r, f in enumerate(files) if f.get("victim")]
    assert codes[victim] == -signal.SIGKILL and all(c == 0 for r, c in enumerate(codes) if r != victim), codes
    return victim, files[victim], [(r, f) for r, f in enumerate(files) if r != victim]


@pytest.mark.parametrize("seed", range(6))
def test_a_peer_killed_at_a_random_moment_is_named_by_every_survivor(seed, tmp_path):
    path = str(tmp_path / "r")
    codes = run_surviving(_stream, (path, seed), NPROCS, timeout=60)
    victim, died, survivors = _survivors(path, codes)
    for r, got in survivors:
        assert got.get("stall") is True, (r, got)  # a StallError, never the system call's RuntimeError
        assert got["shm"] and got["missing"] == [victim], (r, got)
        assert got["at"] - died["dies"] < TIMEOUT + 5, (r, got)


def _read_racing_death(path):
    """Rank 0 kills rank 2 right before it reads rank 2's memory, in the 3rd collective: the read itself fails."""
    r, t = _transport(path)
    if t is None:
        return
    if r == 2:
        _report(path, r, {"victim": True, "dies": time.time()})
    reader, seg = t._worker.engine._peer, t._worker.engine.seg
    real, calls = reader.read, {"n": 0}

    def read(p, pieces, describe):  # on the transport's thread
        calls["n"] += 1
        if p == 2 and t.issued == 3 and calls.get("killed") is None:
            pid = seg.pid(2)
            os.kill(pid, signal.SIGKILL)
            while alive(pid):  # gone or a zombie: its memory is torn down
                time.sleep(0.001)
            calls["killed"] = time.time()
        return real(p, pieces, describe)

    if r == 0:
        reader.read = read
    _three_all_reduces(path, r, t)


def _three_all_reduces(path, r, t):
    result = {}
    try:
        for _ in range(3):
            t.reduce_tensors(_tensors(r)).wait()
        result["completed"] = True
    except Exception as exc:  # noqa: BLE001 - the test asserts the type
        result.update(_outcome(exc))
    _report(path, r, result)


def test_a_read_of_a_dead_peer_names_it(tmp_path):
    path = str(tmp_path / "r")
    codes = run_surviving(_read_racing_death, (path,), NPROCS, timeout=60)
    victim, died, survivors = _survivors(path, codes)
    assert victim == 2
    (_, reader), (_, other) = survivors
    assert reader.get("stall") is True and reader["missing"] == [2], reader
    # Rank 1 also reads rank 2: when its read fails first, its abort word reaches rank 0 before rank 0's own read,
    # and rank 0 reports rank 1's diagnosis. Either way the message names the failed read of rank 2 and its death.
    assert "could not read rank 2's memory in all_reduce" in reader["message"], reader["message"]
    assert "rank 2 died" in reader["message"], reader["message"]
    assert other.get("stall") is True and other["missing"] == [2], other


def _read_after_the_first_to_give_up_left(path):
    """Rank 0 arrives at the 3rd collective, gives up naming rank 2 (the abort word) and leaves before rank 1 reads
    its memory: rank 1's failed read of rank 0 must report the abort's diagnosis (rank 2), not rank 0, which left."""
    r, t = _transport(path)
    if t is None:
        return
    reader, seg = t._worker.engine._peer, t._worker.engine.seg
    real = reader.read

    def leave(p, pieces, describe):  # rank 0, on the transport's thread: arrived, gives up before its first read
        if t.issued == 3:
            seg.abort("rank 0: gave up on rank 2", [2])
            os._exit(0)
        return real(p, pieces, describe)

    def late(p, pieces, describe):  # rank 1: reads rank 0 only once rank 0 is gone
        if p == 0 and t.issued == 3:
            pid, end = seg.pid(0), time.monotonic() + 10
            while alive(pid) and time.monotonic() < end:
                time.sleep(0.001)
        return real(p, pieces, describe)

    if r == 0:
        reader.read = leave
    if r == 1:
        reader.read = late
    _three_all_reduces(path, r, t)


def test_a_read_of_a_peer_that_gave_up_and_left_names_the_one_it_named(tmp_path):
    path = str(tmp_path / "r")
    codes = run_surviving(_read_after_the_first_to_give_up_left, (path,), NPROCS, timeout=60)
    assert codes[0] == 0, codes
    got = pickle.load(open(f"{path}.1", "rb"))
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got.get("stall") is True and got["missing"] == [2], got  # before the fix: [0], the rank that left
    assert "rank 0 gave up first" in got["message"], got["message"]
