"""What torch's own collective tests expect of a backend when a peer is missing, on the ``fanfold`` backend, 2 ranks:
a rank alone in a group's first collective (the shared memory is not set up yet) or in a later one times out after
the group's timeout with an error naming the missing rank in gloo's words (torch's suite matches
``" (Timed out|closed|timeout) "``), and the group works once the peer comes."""
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fanfold

TORCH_PATTERN = " (Timed out|closed|timeout) "  # distributed_test.py's _test_barrier_timeout


def _alone():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    out = {}
    for when in ("first", "later"):
        group = dist.new_group(backend="fanfold", timeout=timedelta(seconds=1))
        if when == "later":
            dist.all_reduce(torch.ones(2), group=group)  # both ranks: the shared memory exists
        if r == 0:  # rank 1 skips this barrier
            start = time.monotonic()
            try:
                dist.barrier(group=group)
                out[when] = (None, 0.0)
            except Exception as exc:  # noqa: BLE001 - the test looks at what arrived
                out[when] = (str(exc), time.monotonic() - start)
        dist.barrier()  # the default group: rank 1 waits here until rank 0 has timed out
        if when == "first":  # the group sets its shared memory up once both come
            x = torch.full((3,), float(r + 1))
            dist.all_reduce(x, group=group)
            out["after"] = (x.tolist(), group.transport is not None)
    dist.destroy_process_group()
    return out


def test_rank_alone_times_out_in_torchs_words():
    out = fanfold.launch(_alone, nprocs=2, timeout=120)
    for when in ("first", "later"):
        message, waited = out[0][when]
        assert message is not None and re.search(TORCH_PATTERN, message), (when, message)
        assert "rank 1" in message or "ranks [1]" in message, (when, message)
        assert 0.9 <= waited < 30, (when, waited)
    for o in out:
        assert o["after"] == ([3.0, 3.0, 3.0], True), o["after"]


def _monitored():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    r, out = dist.get_rank(), {}
    try:  # torch's module-level function asks the backend's name, not the group
        dist.monitored_barrier()
        out["torch"] = None
    except ValueError as exc:
        out["torch"] = str(exc)
    group = dist.new_group(backend="fanfold")  # gloo's pairs of a group whose monitored barrier failed are closed
    group.monitored_barrier(timedelta(seconds=30))  # both ranks: passes
    if r == 0:  # rank 1 skips this one: rank 0 names it
        try:
            group.monitored_barrier(timedelta(seconds=1))
            out["alone"] = None
        except RuntimeError as exc:
            out["alone"] = str(exc)
    dist.barrier()  # rank 1 stays until rank 0 has timed out
    dist.destroy_process_group()
    return out


def test_groups_own_monitored_barrier_is_gloos():
    out = fanfold.launch(_monitored, nprocs=2, timeout=120)
    assert "Rank 1 failed to pass monitoredBarrier" in out[0]["alone"], out[0]["alone"]
    assert all("only implemented for GLOO" in o["torch"] for o in out), out
