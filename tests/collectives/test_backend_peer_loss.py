"""A peer lost to a ``fanfold``-backend collective, whatever the collective, its size and its calling form: the
surviving rank gets :class:`fanfold.StallError` with ``missing == [1]`` -- from the collective itself (sync) or its
``work.wait()`` (async) -- and from every collective it issues after that one on the same group, never a bare
RuntimeError. Two ranks on one host; rank 1 either dies (``os._exit``) or sleeps past the stall timeout. One group
per case (``dist.new_group``: each has its own shared memory, fresh), so one job covers the matrix: every case runs
on a group whose transport has not failed yet, then once more on it (the later collective)."""
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _survivors import run_surviving

import fanfold

STALL = 3.0
SIZES = {"small": 16, "64k": 65536, "1m": 1 << 20}
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_reduce_coalesced", "barrier"]


def _issue(kind, n, group, async_op):
    """Start collective ``kind`` of ``n`` floats per rank on ``group``; its Work (async) or None."""
    x = torch.ones(n)
    if kind == "all_reduce":
        return dist.all_reduce(x, group=group, async_op=async_op)
    if kind == "all_gather":
        return dist.all_gather([torch.empty(n), torch.empty(n)], x, group=group, async_op=async_op)
    if kind == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(torch.empty(2 * n), x, group=group, async_op=async_op)
    if kind == "reduce_scatter_tensor":
        return dist.reduce_scatter_tensor(torch.empty(n), torch.ones(2 * n), group=group, async_op=async_op)
    if kind == "broadcast":
        return dist.broadcast(x, 0, group=group, async_op=async_op)
    if kind == "all_reduce_coalesced":  # torch's async form hands out a future, not a Work: sync only here
        return dist.all_reduce_coalesced([x, torch.ones(3)], group=group)
    return dist.barrier(group=group, async_op=async_op)


def _cases(how):
    cases = []
    for kind in COLLECTIVES:
        for size in (["small"] if kind == "barrier" else SIZES) if how == "dies" else ["1m"]:
            for mode in ("sync",) if kind == "all_reduce_coalesced" else ("sync", "async"):
                cases.append((kind, size, mode))
    return cases


def _outcome(exc, started):
    return {"type": type(exc).__name__, "stall": isinstance(exc, fanfold.StallError),
            "missing": getattr(exc, "missing", None), "message": str(exc)[:600], "took": time.monotonic() - started}


def _survivor(path, how):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    cases = _cases(how)
    groups = [dist.new_group(backend="fanfold", timeout=timedelta(seconds=60)) for _ in cases]
    for g in groups:  # every group's shared memory set up, on both ranks
        dist.all_reduce(torch.ones(2), group=g)
    dist.barrier()
    if r == 1:
        if how == "dies":
            os._exit(3)
        end = time.monotonic() + 2 * STALL * len(cases) + 30
        while not os.path.exists(path) and time.monotonic() < end:  # stalled until rank 0 has seen every case
            time.sleep(0.1)
        os._exit(0)
    out = {}
    for case, g in zip(cases, groups):
        kind, size, mode = case
        for when in ("first", "later"):
            started = time.monotonic()
            try:
                work = _issue(kind, SIZES[size], g, mode == "async")
                if work is not None:
                    work.wait()
                out[case + (when,)] = {"type": None, "took": time.monotonic() - started}
            except Exception as exc:  # noqa: BLE001 - the test looks at what arrived
                out[case + (when,)] = _outcome(exc, started)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(out, f)
    os.rename(path + ".tmp", path)


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_every_backend_collective_names_a_lost_peer(how, tmp_path, monkeypatch):
    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", str(STALL))
    path = str(tmp_path / "out.pkl")
    cases = _cases(how)
    codes = run_surviving(_survivor, (path, how), 2, timeout=60 + 2 * STALL * len(cases))
    assert codes[0] == 0, codes
    with open(path, "rb") as f:
        out = pickle.load(f)
    wrong = {case: o for case, o in out.items() if not (o["stall"] and o["missing"] == [1])}
    assert not wrong, wrong
    for case, o in out.items():
        # bounded: a dead peer is seen at once, a stalled one after the stall timeout (generous on a loaded host)
        assert o["took"] < STALL + 10, (case, o)
    assert len(out) == 2 * len(cases)
