"""The process engine's mailboxes (process_engine.py): messages in order, big ones spilled, every wait bounded; and,
end to end, where the replicas run (replica 0 in the caller) and a spilled argument, against the bare module."""
import copy
import os
import threading
import time

import pytest
import torch
from torch import nn

from fanfold import DataParallel
from fanfold.parallel.process_engine import _AREA, WORKER, Mailbox, Stopped

TOL = dict(rtol=1e-4, atol=1e-5)


def no_check():
    pass


def test_messages_alternate_in_order_and_big_ones_are_spilled():
    caller = Mailbox()
    worker = Mailbox(caller.block, WORKER)
    big = list(range(3 * _AREA // 8))  # pickles to more than one area
    shared = torch.arange(5.0).share_memory_()
    seen = []

    def serve():
        for _ in range(202):
            msg = worker.receive(no_check, time.monotonic() + 30)
            seen.append(msg)
            worker.send(("echo", msg))

    t = threading.Thread(target=serve)
    t.start()
    try:
        for i in range(200):
            caller.send(i)
            assert caller.receive(no_check, time.monotonic() + 30) == ("echo", i)
        caller.send({"big": big})
        assert caller.receive(no_check, time.monotonic() + 30) == ("echo", {"big": big})
        caller.send(shared)  # a tensor crosses by its file descriptor, as through a pipe
        kind, echoed = caller.receive(no_check, time.monotonic() + 30)
        assert kind == "echo" and torch.equal(echoed, shared)
    finally:
        t.join(30)
    assert seen[:200] == list(range(200))


def test_every_wait_is_bounded_and_stop_wakes_the_worker():
    caller = Mailbox()
    worker = Mailbox(caller.block, WORKER)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        caller.receive(no_check, time.monotonic() + 0.3)
    assert 0.25 < time.monotonic() - start < 15  # its deadline, with a margin for a loaded machine

    def peer_gone():
        raise RuntimeError("the peer's process is gone")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer's process is gone"):
        caller.receive(peer_gone)  # no deadline: the check still runs every 50 ms
    assert time.monotonic() - start < 15

    errors = []

    def wait_for_request():
        try:
            worker.receive(no_check)
        except Stopped as exc:
            errors.append(exc)

    t = threading.Thread(target=wait_for_request)
    t.start()
    time.sleep(0.2)
    caller.stop()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1


class WhereAmI(nn.Module):
    """Returns its output and, per row, the process that computed it; ``table`` is a big non-tensor argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, table):
        if x.isnan().any():
            raise ValueError(f"nan in a chunk of {len(x)} rows")
        pid = torch.full((len(x),), os.getpid(), dtype=torch.int64)
        return self.fc(x) * table[len(x)], pid


@pytest.mark.parametrize("replicas", [2, 3])
def test_replica_0_runs_in_the_caller_and_a_big_argument_is_spilled(replicas):
    torch.manual_seed(0)
    bare = WhereAmI()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * replicas, engine="process")
    table = [float(i % 7) / 7 for i in range(3 * _AREA // 8)]  # pickled, bigger than a mailbox's area
    x = torch.randn(6 * replicas, 3)
    try:
        out, pids = dp(x, table=table)
        assert len(dp._processes._procs) == replicas - 1  # N replicas take N processes, the caller's included
        chunks = pids.chunk(replicas)
        assert set(chunks[0].tolist()) == {os.getpid()}
        workers = [p.pid for p in dp._processes._procs]
        assert [set(c.tolist()) for c in chunks[1:]] == [{pid} for pid in workers]
        expected = torch.cat([bare(c, table)[0] for c in x.chunk(replicas)])
        torch.testing.assert_close(out, expected, **TOL)
        out.sum().backward()
        torch.cat([bare(c, table)[0] for c in x.chunk(replicas)]).sum().backward()
        for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **TOL)
        workers = list(dp._processes._procs)
        x[0, 0] = float("nan")  # replica 0's error, raised in the caller, names it and chains the original
        with pytest.raises(ValueError, match=r"in replica 0 \(engine='process', run by the caller\).*nan in a chunk "
                                             r"of 6 rows") as caught:
            dp(x, table=table)
        assert isinstance(caught.value.__cause__, ValueError)
        assert dp._processes._procs == workers and all(p.is_alive() for p in workers)  # the workers stay up
        x[0, 0] = 0.0
        torch.testing.assert_close(dp(x, table=table)[0], torch.cat([bare(c, table)[0] for c in x.chunk(replicas)]),
                                   **TOL)
    finally:
        dp.close()


class MaybeUnpicklable(nn.Module):
    """With ``bad``, its output holds a lambda: the worker cannot send it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, bad=False, extra=None):
        return self.fc(x), ((lambda: 0) if bad else None)


def test_what_cannot_be_pickled_is_an_error_and_grown_slots_are_sent_again():
    torch.manual_seed(0)
    bare = MaybeUnpicklable()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    small, big = torch.randn(4, 3), torch.randn(4000, 3)  # the big batch grows both slot buffers
    try:
        torch.testing.assert_close(dp(small)[0], bare(small)[0], **TOL)
        with pytest.raises(RuntimeError, match=r"in replica 1 .*cannot send it its arguments"):
            dp(big, extra=lambda: 0)  # replica 1's arguments: grown into its slots, then not picklable
        with pytest.raises(RuntimeError, match=r"in replica 1 .*cannot send the replica's answer"):
            dp(big, bad=True)  # replica 1's output: grown into its slots, then not picklable
        out = dp(big)[0]  # both buffers must reach the worker and the caller again
        torch.testing.assert_close(out, bare(big)[0], **TOL)
        out.sum().backward()
        bare(big)[0].sum().backward()
        for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **TOL)
    finally:
        dp.close()
