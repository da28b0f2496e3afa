"""Stall inspector: bounded waits, published progress, and errors that name the rank, collective and missing ranks.

Unit tests drive two inspectors over one in-process store with futures that never complete; the scenario tests run
two real gloo ranks (a skipped backward, an extra step, a SIGKILLed rank) and assert on every message.
"""
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fanfold.collectives.stall import InspectedTransport, StallError, caller_line, read_progress
from fanfold.collectives.timeouts import DEFAULT_STALL_TIMEOUT, resolve_stall_timeout
from fanfold.distributed import DistributedDataParallel, free_port

HERE = os.path.abspath(__file__)


class _FutureTransport:
    """all_reduce returns a future the test completes (or never does), or a completed one once ``done`` is set."""

    def __init__(self):
        self.futures, self.done = [], False

    def all_reduce(self, tensor, bucket=None, divisor=None):
        self.futures.append(torch.futures.Future())
        if self.done:
            self.futures[-1].set_result(None)
        return self.futures[-1]

    def broadcast(self, tensor, src):
        return None

    def barrier(self):
        raise AssertionError("InspectedTransport.barrier goes through the store, never to the inner barrier")


def _pair(timeout=0.3):
    store = dist.HashStore()
    return [InspectedTransport(_FutureTransport(), timeout=timeout, store=store, rank=r, world_size=2) for r in (0, 1)]


def test_completed_collective_returns_result_and_publishes_progress():
    t0, t1 = _pair()
    h = t0.all_reduce(torch.ones(2), bucket=0)
    t0.inner.futures[0].set_result("done")
    assert h.wait() == "done"
    t1._start("barrier")  # what rank 1 publishes while inside a barrier
    t0.flush(), t1.flush()  # records are written by a background thread
    progress = read_progress(t0.store, 1)
    assert progress["last"][:3] == progress["pending"][0][:3] == [1, "barrier", None]
    assert read_progress(t0.store, 0)["pending"] == []
    assert t0.broadcast(torch.ones(1), 0) is None  # a synchronous inner call completes at once


def test_barrier_is_bounded_and_goes_through_the_store():
    t0, t1 = _pair()
    other = threading.Thread(target=t1.barrier)
    other.start()
    assert t0.barrier() is None  # both arrive: both return
    other.join(5)
    assert not other.is_alive()
    t1.flush()
    with pytest.raises(StallError) as e:  # rank 1 does not come to the second one
        t0.barrier()
    assert str(e.value).startswith(f"rank 0 of 2: barrier #2 started at {HERE}:")
    assert "did not complete within 0.3 s. Ranks that never arrived: [1]." in str(e.value)
    assert "rank 1: behind: its last collective is barrier #1 started at " in str(e.value)


def test_timeout_names_rank_collective_line_and_the_rank_behind():
    t0, t1 = _pair()
    for b in (0, 1):
        t1.all_reduce(torch.ones(1), bucket=b)
        t1.inner.futures[b].set_result(None)
    h1 = t1.all_reduce(torch.ones(1), bucket=0)
    t1.inner.futures[-1].set_result(None)
    h1.wait()  # rank 1 completed #1..#3 and then stopped issuing collectives
    t1.flush()
    for b in (0, 1, 0, 1):
        handle = t0.all_reduce(torch.ones(1), bucket=b)
    line = f"{HERE}:{sys._getframe().f_lineno - 1} in test_timeout_names_rank_collective_line_and_the_rank_behind"
    start = time.monotonic()
    with pytest.raises(StallError) as e:
        handle.wait()
    assert time.monotonic() - start < 15  # the stall timeout (0.3 s) with a margin for a loaded machine
    msg = str(e.value)
    assert msg.startswith(f"rank 0 of 2: all_reduce #4 (bucket 1) started at {line} did not complete within 0.3 s.")
    assert "Ranks that never arrived: [1]." in msg
    assert "rank 1: behind: its last collective is all_reduce #3 (bucket 0) started at" in msg
    assert "completed it" in msg and "FANFOLD_STALL_TIMEOUT" in msg
    assert (e.value.rank, e.value.seq, e.value.kind, e.value.bucket, e.value.missing) == (0, 4, "all_reduce", 1, [1])


def test_mismatched_collective_ahead_and_silent_ranks():
    t0, t1 = _pair()
    h = t0.all_reduce(torch.ones(1), bucket=0)
    t1._start("barrier")
    t1.flush()
    with pytest.raises(StallError, match=r"rank 1: in a different collective with the same number: barrier #1 ") as e:
        h.wait()
    assert e.value.missing == [1]
    t1.inner.done = True
    t1.all_reduce(torch.ones(1)).wait(), t1.all_reduce(torch.ones(1)).wait()  # rank 1 is past rank 0's #2
    t1.flush()
    h = t0.all_reduce(torch.ones(1), bucket=2)
    with pytest.raises(StallError, match=r"rank 1: ahead: past #2, its last collective is all_reduce #3 ") as e:
        h.wait()
    assert e.value.missing == [1] and e.value.seq == 2
    lone = InspectedTransport(_FutureTransport(), timeout=0.2, store=dist.HashStore(), rank=0, world_size=3)
    with pytest.raises(StallError, match=r"never arrived: \[1, 2\]") as e:
        lone.all_reduce(torch.ones(1)).wait()
    assert "rank 2: has not issued any fanfold collective" in str(e.value)


def test_failed_wait_names_dead_peer_and_cause():
    t0, t1 = _pair(timeout=30)
    t1.all_reduce(torch.ones(1), bucket=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t1._publish(pid=dead.pid)  # rank 1's process is gone (exited and reaped)
    t1.flush()
    t0.all_reduce(torch.ones(1), bucket=0)
    h = t0.all_reduce(torch.ones(1), bucket=1)
    t0.inner.futures[1].set_exception(RuntimeError("Connection reset by peer"))
    start = time.monotonic()
    with pytest.raises(StallError) as e:
        h.wait()
    assert time.monotonic() - start < 15  # a failure is diagnosed at once, not after the 30 s timeout
    msg = str(e.value)
    assert msg.startswith("rank 0 of 2: all_reduce #2 (bucket 1) started at ") and "failed (RuntimeError)" in msg
    assert "cause: RuntimeError: Connection reset by peer" in msg
    assert "rank 1: behind: its last collective is all_reduce #1 (bucket 0)" in msg
    assert f"its process {dead.pid} is gone" in msg and e.value.missing == [1]
    assert e.value.gone == [1]  # a consequence of rank 1's death: fanfold run blames rank 1
    assert isinstance(e.value.__cause__, RuntimeError)


class _ShmLikeWork:
    """A handle whose own wait() would block forever; its get_future() lets the inspector bound the wait."""

    def __init__(self):
        self.future = torch.futures.Future()

    def wait(self):
        return self.future.wait()

    def get_future(self):
        return self.future


def test_handle_with_a_future_is_bounded_too():
    inner = _FutureTransport()
    inner.all_reduce = lambda tensor, bucket=None, divisor=None: _ShmLikeWork()
    alone = InspectedTransport(inner, timeout=0.2, store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(StallError, match=r"all_reduce #1 \(bucket 4\) .* within 0.2 s. Ranks that never arrived: none"):
        alone.all_reduce(torch.ones(1), bucket=4).wait()


def test_instances_number_separately_and_timeout_resolution(monkeypatch):
    store = dist.HashStore()
    a = InspectedTransport(_FutureTransport(), timeout=1, store=store, rank=0, world_size=2)
    b = InspectedTransport(_FutureTransport(), timeout=1, store=store, rank=0, world_size=2)
    a.inner.done = b.inner.done = True
    a.all_reduce(torch.ones(1)).wait(), a.all_reduce(torch.ones(1)).wait()
    b.all_reduce(torch.ones(1)).wait()
    a.flush(), b.flush()
    assert (read_progress(a.store, 0)["last"][0], read_progress(b.store, 0)["last"][0]) == (2, 1)
    monkeypatch.delenv("FANFOLD_STALL_TIMEOUT", raising=False)
    assert resolve_stall_timeout() == DEFAULT_STALL_TIMEOUT == 300
    assert resolve_stall_timeout(timedelta(seconds=7)) == 7
    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", "2.5")
    assert resolve_stall_timeout() == 2.5 and resolve_stall_timeout(4) == 4
    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FANFOLD_STALL_TIMEOUT must be a number of seconds, got 'soon'"):
        resolve_stall_timeout()
    with pytest.raises(ValueError, match="stall_timeout must be positive, got 0"):
        resolve_stall_timeout(0)
    assert caller_line().startswith(f"{HERE}:")


# --- two real gloo ranks ------------------------------------------------------------------------------------------

STALL = 4.0  # seconds; each scenario must end within STALL + 30 s


def _child(fn, args, rank, env, conn):
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    # No process-group teardown: it would wait for gloo's own timeout on the collective this scenario abandoned.
    os._exit(0)


def _run_ranks(fn, *args, nprocs=2, timeout=60.0):
    """Like fanfold.launch, but a rank that dies (the SIGKILL scenario) does not end the run: the others report.
    Returns per rank ("ok", result), ("error", message) or ("died", exitcode)."""
    ctx = mp.get_context("forkserver")
    # the caller's environment as it is now: the forkserver's children inherit the one of its start
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nprocs),
           "LOCAL_WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": "1"}
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            procs.append(ctx.Process(target=_child, args=(fn, args, rank, env, send)))
            procs[-1].start()
            send.close()
            conns.append(recv)
        deadline = time.monotonic() + timeout
        out = []
        for p, c in zip(procs, conns):
            try:
                if c.poll(max(0.0, deadline - time.monotonic())):
                    out.append(c.recv())
                    continue
            except EOFError:
                pass
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                raise TimeoutError(f"rank {len(out)} still running after {timeout} s")
            out.append(("died", p.exitcode))
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _scenario(name):
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    start = time.monotonic()  # the ranks leave the rendezvous together: the scenario's own time, start-up excluded
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    ddp = DistributedDataParallel(model, transport="torch", stall_timeout=STALL)
    try:
        for step in range(3 + (name == "extra" and rank == 1)):
            loss = ddp(torch.randn(8, 4)).pow(2).mean()
            if name == "kill" and rank == 1 and step == 1:
                time.sleep(0.5)  # killed mid-step, not in the millisecond its last record takes to reach the store
                os.kill(os.getpid(), signal.SIGKILL)
            if name == "skip" and rank == 1 and step == 1:
                continue
            loss.backward()  # BACKWARD
        if name == "skip":
            ddp.transport.barrier()  # BARRIER: the usual barrier before saving a checkpoint
    except StallError as exc:
        return (str(exc), exc.missing, exc.seq), time.monotonic() - start
    finally:
        # No rank leaves before every live rank has diagnosed (an exit would fail the others' waits early), and
        # rank 0, whose process holds the store, leaves last.
        alive = range(2 if name != "kill" else 1)
        try:
            store.set(f"done/{rank}", "1")
            store.wait([f"done/{r}" for r in alive], timedelta(seconds=30))
            store.set(f"left/{rank}", "1")
            if rank == 0:
                store.wait([f"left/{r}" for r in alive], timedelta(seconds=30))
        except Exception:
            pass  # the result above is what the test checks
    return "finished", time.monotonic() - start


def _line(tag):
    with open(HERE) as f:
        n = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {tag}") or f"# {tag}:" in text)
    return f"{HERE}:{n} in _scenario"


def _timed(name):
    """Each rank's result; each live rank's scenario (three steps and the stall) ended within the stall timeout
    and a margin for a loaded machine, below the group's 30 s timeout."""
    out = _run_ranks(_scenario, name, timeout=STALL + 240)  # start-up included: slow on a loaded machine
    for r, (status, got) in enumerate(out):
        if status == "ok":
            assert got[1] < STALL + 20, (r, got)
    return [(status, got[0] if status == "ok" else got) for status, got in out]


def test_skipped_backward_is_diagnosed_on_both_ranks():
    # Collectives: #1 model check, #2 parameter broadcast, #3 step 0's bucket, #4 bucket-order broadcast, then one
    # bucket a step. Rank 1 skips step 1's backward, so its barrier meets rank 0's last bucket: both are #6.
    (r0, (msg0, missing0, seq0)), (r1, (msg1, missing1, seq1)) = _timed("skip")
    assert (r0, r1, seq0, seq1, missing0, missing1) == ("ok", "ok", 6, 6, [1], [0])
    assert msg0.startswith(f"rank 0 of 2: DistributedDataParallel's all_reduce #6 (bucket 0) started at "
                           f"{_line('BACKWARD')} did not complete within {STALL:g} s. Ranks that never arrived: [1].")
    assert f"rank 1: in a different collective with the same number: barrier #6 started at {_line('BARRIER')}" in msg0
    assert msg1.startswith(f"rank 1 of 2: DistributedDataParallel's barrier #6 started at {_line('BARRIER')} did not "
                           "complete")
    assert ("rank 0: in a different collective with the same number: all_reduce #6 (bucket 0) started at "
            f"{_line('BACKWARD')}") in msg1


def test_extra_step_is_diagnosed_by_the_rank_that_took_it():
    (r0, res0), (r1, (msg1, missing1, seq1)) = _timed("extra")
    assert (r0, res0, r1, missing1, seq1) == ("ok", "finished", "ok", [0], 7)
    assert msg1.startswith(f"rank 1 of 2: DistributedDataParallel's all_reduce #7 (bucket 0) started at "
                           f"{_line('BACKWARD')} did not complete within {STALL:g} s. Ranks that never arrived: [0].")
    assert (f"rank 0: behind: its last collective is all_reduce #6 (bucket 0) started at {_line('BACKWARD')}, "
            "completed it") in msg1


def test_killed_rank_is_diagnosed_at_once_as_gone():
    (r0, (msg0, missing0, seq0)), (r1, code) = _timed("kill")
    assert (r0, missing0, seq0, r1, code) == ("ok", [1], 5, "died", -signal.SIGKILL)
    backward = _line("BACKWARD")
    assert msg0.startswith(f"rank 0 of 2: DistributedDataParallel's all_reduce #5 (bucket 0) started at {backward} "
                           "failed (RuntimeError).")
    assert re.search(rf"rank 1: behind: its last collective is broadcast\(src=0\) #4 started at {re.escape(backward)}, "
                     r"completed it; its process \d+ is gone", msg0)
    assert "cause: RuntimeError: " in msg0 and "Connection" in msg0  # gloo's own words


def test_every_inspected_collective_is_a_named_span_in_torch_profiler_traces():
    t0, _ = _pair()
    t0.inner.done = True  # every collective completes at once
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0.all_reduce(torch.ones(2)).wait()
        t0.all_reduce(torch.ones(2)).wait()
        t0.broadcast(torch.ones(1), 0)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("fanfold.all_reduce") == 2 and counts.get("fanfold.broadcast") == 1, counts
    t0.all_reduce(torch.ones(2)).wait()  # no profiler: no span, and nothing left open
    assert t0._pending == []


def test_stall_timeout_block_and_group_timeout_bound_each_collective(monkeypatch):
    from fanfold import stall_timeout
    from fanfold.collectives.timeouts import bound

    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", "0.2")
    assert bound(resolve_stall_timeout()) == 0.2 and bound(300, 60) == 60  # the smaller of the two
    with stall_timeout(30):
        assert bound(300, 60) == 30 and bound(300, 10) == 10  # the block's, never above the group's
        with stall_timeout(timedelta(seconds=45)):
            assert bound(300, 60) == 45
        assert bound(300, 60) == 30
    assert bound(300, 60) == 60  # undone on the way out

    def never(timeout=None, limit=None):
        t = InspectedTransport(_FutureTransport(), timeout=timeout, store=dist.HashStore(), rank=0, world_size=2)
        t.limit = limit  # the group's timeout
        return t, t.all_reduce(torch.ones(1))

    _, handle = never()  # $FANFOLD_STALL_TIMEOUT
    with pytest.raises(StallError, match="did not complete within 0.2 s"):
        handle.wait()
    with stall_timeout(0.6):  # a phase lengthened: the bound is taken when the collective starts
        _, handle = never()
    start = time.monotonic()
    with pytest.raises(StallError, match="did not complete within 0.6 s"):
        handle.wait()
    assert time.monotonic() - start >= 0.55
    _, handle = never(timeout=30, limit=0.3)  # the group's timeout is shorter: it wins
    with pytest.raises(StallError, match="did not complete within 0.3 s"):
        handle.wait()


def test_the_groups_alarm_ends_every_inspectors_waits_at_once():
    # rank 0's inspector diagnoses a stall; rank 1's waits (another feature's transport, its barrier) end at once
    store = dist.HashStore()
    r0 = InspectedTransport(_FutureTransport(), timeout=0.3, store=store, rank=0, world_size=2)
    r1 = InspectedTransport(_FutureTransport(), timeout=60, store=store, rank=1, world_size=2, feature="fanfold.save")
    pending = r1.all_reduce(torch.ones(1))
    with pytest.raises(StallError, match="Ranks that never arrived: \\[1\\]"):
        r0.all_reduce(torch.ones(1), bucket=0).wait()
    start = time.monotonic()
    with pytest.raises(StallError) as e:
        pending.wait()
    assert time.monotonic() - start < 30  # at once, not after the 60 s of its own timeout
    assert str(e.value).startswith("rank 1 of 2: fanfold.save's all_reduce #1 ")
    assert "was ended: rank 0 had diagnosed a stall (rank 0 of 2: all_reduce #1 (bucket 0)" in str(e.value)
    with pytest.raises(StallError, match="was ended: rank 0 had diagnosed a stall"):
        r1.barrier()
