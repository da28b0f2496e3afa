"""parallel_apply and WorkerPool: results in order, carried thread state, persistent daemon threads, errors."""
import subprocess
import sys
import threading
import traceback

import pytest
import torch
from torch import nn

from fanfold import WorkerPool, parallel_apply


class Probe(nn.Module):
    """Returns what its thread sees: thread id, grad mode, autocast, intra-op threads, and a result."""

    def forward(self, x, *, shift=0.0):
        return {
            "thread": threading.get_ident(),
            "grad": torch.is_grad_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "dtype": torch.get_autocast_dtype("cpu"),
            "threads": torch.get_num_threads(),
            "y": x * 2 + shift,
        }


class FailOn(nn.Module):
    def __init__(self, bad, exc=ValueError):
        super().__init__()
        self.bad, self.exc, self.done = bad, exc, []

    def forward(self, i):
        if i == self.bad:
            raise self.exc(f"boom in {i}")
        self.done.append(i)
        return torch.tensor(float(i))


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


def test_results_in_order_with_kwargs_and_single_arguments():
    xs = [torch.full((2,), float(i)) for i in range(4)]
    with WorkerPool() as pool:
        outs = parallel_apply([Probe()] * 4, xs, [{"shift": i} for i in range(4)], ["cpu"] * 4, pool=pool)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], xs[i] * 2 + i)
    assert len({o["thread"] for o in outs}) == 4


def test_threads_persist_across_calls_and_are_daemons():
    pool = WorkerPool()
    first = [o["thread"] for o in parallel_apply([Probe()] * 3, [torch.ones(1)] * 3, pool=pool)]
    def replica_threads():  # other tests' threads (tqdm's monitor, ...) may come and go meanwhile
        return {t.ident for t in threading.enumerate() if t.name.startswith("fanfold-replica-")}

    before = replica_threads()
    for _ in range(5):
        again = [o["thread"] for o in parallel_apply([Probe()] * 3, [torch.ones(1)] * 3, pool=pool)]
        assert again == first  # worker i runs replica i, no new thread
    assert replica_threads() == before
    assert all(t.daemon for t in pool._threads)
    pool.close()
    for t in pool._threads:
        t.join(timeout=30)
        assert not t.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        parallel_apply([Probe()] * 2, [torch.ones(1)] * 2, pool=pool)


def test_without_a_pool_threads_are_short_lived():
    before = {t.ident for t in threading.enumerate()}
    outs = parallel_apply([Probe()] * 2, [torch.ones(1)] * 2)
    workers = [t for t in threading.enumerate() if t.ident in {o["thread"] for o in outs}]
    for t in workers:
        t.join(timeout=30)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before


def test_one_module_runs_inline():
    (out,) = parallel_apply([Probe()], [torch.ones(1)])
    assert out["thread"] == threading.get_ident()


def test_grad_mode_and_autocast_carried_into_workers():
    with WorkerPool() as pool:
        with torch.no_grad():
            outs = parallel_apply([Probe()] * 2, [torch.ones(1, requires_grad=True)] * 2, pool=pool)
        assert [o["grad"] for o in outs] == [False, False]
        assert not any(o["y"].requires_grad for o in outs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = parallel_apply([Probe()] * 2, [torch.ones(1)] * 2, pool=pool)
        assert [(o["autocast"], o["dtype"]) for o in outs] == [(True, torch.bfloat16)] * 2
        outs = parallel_apply([Probe()] * 2, [torch.ones(1, requires_grad=True)] * 2, pool=pool)
        assert [(o["grad"], o["autocast"]) for o in outs] == [(True, False)] * 2
        assert all(o["y"].requires_grad for o in outs)


def test_intra_op_threads_per_worker_and_caller_unchanged():
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with WorkerPool() as pool:
            outs = parallel_apply([Probe()] * 2, [torch.ones(1)] * 2, pool=pool)
            assert [o["threads"] for o in outs] == [2, 2]
        with WorkerPool(threads_per_worker=3) as pool:
            outs = parallel_apply([Probe()] * 2, [torch.ones(1)] * 2, pool=pool)
            assert [o["threads"] for o in outs] == [3, 3]
        assert torch.get_num_threads() == 4
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [4]  # the process-wide default was restored for new threads
    finally:
        torch.set_num_threads(saved)


def test_exception_names_replica_and_device_and_pool_survives():
    m = FailOn(bad=1)
    with WorkerPool() as pool:
        with pytest.raises(ValueError, match=r"in replica 1 on device cpu: ValueError: boom in 1") as info:
            parallel_apply([m] * 3, [0, 1, 2], devices=["cpu"] * 3, pool=pool)
        assert sorted(m.done) == [0, 2]  # the other replicas ran to the end
        cause = info.value.__cause__
        assert isinstance(cause, ValueError) and str(cause) == "boom in 1"
        frames = "".join(traceback.format_exception(cause))
        assert "in forward" in frames and 'raise self.exc(f"boom in {i}")' in frames
        outs = parallel_apply([FailOn(bad=None)] * 3, [0, 1, 2], pool=pool)
        assert [o.item() for o in outs] == [0.0, 1.0, 2.0]


def test_exception_that_cannot_be_rebuilt_becomes_runtime_error():
    with pytest.raises(RuntimeError, match="in replica 0 on device cpu: NeedsTwoArgs") as info:
        parallel_apply([FailOn(bad=0, exc=lambda msg: NeedsTwoArgs(msg, 1))] * 2, [0, 1])
    assert isinstance(info.value.__cause__, NeedsTwoArgs)
    with pytest.raises(KeyError, match="in replica 0 on device cpu"):
        parallel_apply([FailOn(bad=0, exc=KeyError)], [0])  # inline path too


def test_device_inferred_from_inputs_or_parameters():
    m = FailOn(bad=0)
    with pytest.raises(ValueError, match="on device cpu"):
        parallel_apply([m, m], [0, 1])  # no tensor: the module's (absent) parameters -> cpu


def test_length_mismatches():
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        parallel_apply([Probe()] * 2, [torch.ones(1)])
    with pytest.raises(ValueError, match="2 modules but 3 kwargs_tup"):
        parallel_apply([Probe()] * 2, [torch.ones(1)] * 2, [{}] * 3)
    with pytest.raises(ValueError, match="2 modules but 1 devices"):
        parallel_apply([Probe()] * 2, [torch.ones(1)] * 2, None, ["cpu"])
    with pytest.raises(ValueError, match="threads_per_worker"):
        WorkerPool(threads_per_worker=0)


def test_pool_threads_do_not_keep_the_interpreter_alive():
    code = (
        "import torch, fanfold\n"
        "pool = fanfold.WorkerPool()\n"
        "fanfold.parallel.parallel_apply([torch.nn.Linear(2, 2)] * 2, [torch.ones(1, 2)] * 2, pool=pool)\n"
        "keep = pool  # never closed\n"
        "print('done')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
