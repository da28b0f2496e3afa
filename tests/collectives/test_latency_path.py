"""The latency path of the ``fanfold`` backend, 2 and 3 ranks, against gloo in the same processes: a small all_reduce
issued while nothing is queued runs on the caller's thread and is complete when the call returns; one issued behind
queued collectives waits its turn (issue order kept); every result is gloo's (integers: exactly)."""
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fanfold


def _x(n, r, seed):
    return (torch.randn(n, generator=torch.Generator().manual_seed(100 * seed + r)) * 1000).round().to(torch.int64)


def _latency_path():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    dist.barrier()
    worker = dist.group.WORLD.transport._worker
    engine = worker.engine
    threads, run, run_small = [], engine.run, engine.run_small

    def recording(c):
        threads.append(threading.current_thread() is threading.main_thread())
        run(c)

    def recording_small(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        run_small(*args)
    engine.run, engine.run_small = recording, recording_small
    out = {"bad": []}
    # nothing queued: on this thread, done when the call returns
    for k, n in enumerate([1, 1000, 8192]):  # 8192 int64: 64 KiB, the largest inline size
        x = _x(n, r, k)
        want = x.clone()
        dist.all_reduce(want, group=gloo)
        work = dist.all_reduce(x, async_op=True)
        if not (work.is_completed() and torch.equal(x, want)):
            out["bad"].append(("inline", n))
    out["inline"] = list(threads)
    threads.clear()
    # behind a large collective in flight: queued in issue order, not run ahead of it
    big, small, larger = _x(3_000_000, r, 7), _x(10, r, 8), _x(8193, r, 9)
    wants = [t.clone() for t in (big, small, larger)]
    for w in wants:
        dist.all_reduce(w, group=gloo)
    works = [dist.all_reduce(t, async_op=True) for t in (big, small, larger)]
    for w in works:
        w.wait()
    if not all(torch.equal(a, b) for a, b in zip((big, small, larger), wants)):
        out["bad"].append("queued")
    out["queued"] = list(threads)
    # right after a queued collective is waited nothing is left unfinished: the next small one is inline again
    # (its caller used to wake before the transport's thread had counted the queued one done, and queue behind it)
    out["after"] = []
    for k in range(20):
        queued, after = _x(100_000, r, 20 + k), _x(10, r, 40 + k)
        want = after.clone()
        dist.all_reduce(want, group=gloo)
        dist.all_reduce(queued, async_op=True).wait()
        threads.clear()
        work = dist.all_reduce(after, async_op=True)
        out["after"].append(threads == [True] and work.is_completed() and torch.equal(after, want))
    engine.run, engine.run_small = run, run_small
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_small_all_reduce_runs_on_the_callers_thread_in_order(nprocs):
    for out in fanfold.launch(_latency_path, nprocs=nprocs, timeout=240):
        assert out["bad"] == [], out["bad"]
        assert out["inline"] == [True, True, True], out["inline"]
        # the small one behind the large one went through the transport's thread; so did the one above 64 KiB
        assert out["queued"][1:] == [False, False], out["queued"]
        assert all(out["after"]), out["after"]


def _latency_path_errors():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    out = {}
    # a Parameter that requires grad is summed in place, as gloo does, on the latency path
    p = torch.nn.Parameter(torch.arange(6.0).view(2, 3) * (r + 1))
    want = p.detach().clone()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(p)
    out["param"] = torch.equal(p.detach(), want) and p.requires_grad
    # ranks disagree on the dtype: the async call returns a Work, and its wait() raises naming the mismatch
    x = torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait()
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    dist.destroy_process_group()
    return out


def test_small_all_reduce_errors_surface_at_wait_and_parameters_are_summed():
    for out in fanfold.launch(_latency_path_errors, nprocs=2, timeout=240):
        assert out["param"]
        assert out["error"] is not None and "same collectives" in out["error"], out["error"]


def _sum_after_max():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    bad = []
    for k, (op, n) in enumerate([(dist.ReduceOp.MAX, 5), (dist.ReduceOp.SUM, 7), (dist.ReduceOp.PRODUCT, 300_000),
                                 (dist.ReduceOp.SUM, 3), (dist.ReduceOp.AVG, 9)]):
        x = _x(n, r, 20 + k).to(torch.float64)
        want = x.clone()
        dist.all_reduce(want, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=gloo)
        if op == dist.ReduceOp.AVG:
            want /= dist.get_world_size()
        dist.all_reduce(x, op=op)
        if not torch.equal(x, want):
            bad.append((str(op), n))
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("nprocs", [2, 3])
def test_small_sums_after_other_reductions_are_sums(nprocs):
    # the latency path sums whatever reduction the engine ran last (MIN, MAX, PRODUCT on the queued path)
    for bad in fanfold.launch(_sum_after_max, nprocs=nprocs, timeout=240):
        assert bad == [], bad
