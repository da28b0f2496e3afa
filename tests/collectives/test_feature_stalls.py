"""Every feature that reaches other ranks does so through an inspected transport: when one rank skips the feature's
collective, the other raises StallError naming the feature and the collective, within the stall timeout.

Two real gloo ranks per case: both set the feature up, then rank 1 skips its collective (DDP's backward, ZeRO's
step at stage 1 and 2, stage 2's backward, clip_grad_norm_, a pipeline's data parallelism, SyncBatchNorm's forward,
fanfold.save, fanfold.load of a checkpoint holding the sampler's resume point) and waits for rank 0's verdict; no rank
is left behind (``_run_ranks`` kills what outlives the deadline).
"""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_stall import _run_ranks

import fanfold

STALL = 2.0  # seconds: $FANFOLD_STALL_TIMEOUT in the ranks


def _skip_one(case, path):
    os.environ["FANFOLD_STALL_TIMEOUT"] = str(STALL)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    start = time.monotonic()
    try:
        issue = _prepare(case, rank, path)
        start = time.monotonic()  # the collective rank 1 skips
        if rank == 0:
            issue()
            return "no stall"
        return "skipped"
    except fanfold.StallError as exc:
        return str(exc), exc.feature, exc.kind, exc.missing, time.monotonic() - start
    finally:
        # rank 1 waits here until rank 0 has its verdict (its exit would fail rank 0's wait early); rank 0, whose
        # process holds the store, leaves last
        try:
            store.set(f"done/{rank}", "1")
            store.wait(["done/0", "done/1"], timedelta(seconds=30))
            store.set(f"left/{rank}", "1")
            if rank == 0:
                store.wait(["left/1"], timedelta(seconds=30))
        except Exception:
            pass


def _prepare(case, rank, path):
    """Every rank's set-up (collectives included); returns rank 0's part: the collective rank 1 never issues."""
    x = torch.randn(4, 4)
    if case in ("DistributedDataParallel", "ZeRO stage 2 step", "ZeRO stage 2 backward"):
        model = fanfold.DistributedDataParallel(torch.nn.Linear(4, 2))
        if case == "DistributedDataParallel":
            model(x).sum().backward()  # every rank: the first backward (its buckets' order broadcast)
            return lambda: model(x).sum().backward()
        opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        model.shard_gradients(opt)
        if case == "ZeRO stage 2 backward":
            return lambda: model(x).sum().backward()
        model(x).sum().backward()  # every rank: the gradients' reduce-scatter
        return opt.step
    if case == "ZeRO stage 1 step":
        net = torch.nn.Linear(4, 2)
        opt = fanfold.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
        net(x).sum().backward()
        return opt.step
    if case == "clip_grad_norm_":
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        return lambda: fanfold.clip_grad_norm_([p], 1.0, process_group=dist.group.WORLD)
    if case == "Pipeline data parallelism":
        pipe = fanfold.Pipeline(torch.nn.Sequential(torch.nn.Linear(4, 2)), balance=[1], chunks=2)
        pipe.data_parallel_group = dist.group.WORLD  # set after construction: only rank 0 reaches the gradients
        return lambda: pipe.train_step(x, torch.randn(4, 2), torch.nn.functional.mse_loss)
    if case == "SyncBatchNorm":
        return lambda: fanfold.SyncBatchNorm(3)(torch.randn(4, 3))
    if case == "fanfold.save":
        return lambda: fanfold.save(path, {"weights": torch.ones(2)})
    if case == "fanfold.load":
        sampler = fanfold.DistributedSampler(range(10), num_replicas=2, rank=rank)
        fanfold.save(path, {"sampler": sampler})  # both ranks: the checkpoint to resume from
        return lambda: fanfold.load(path, {"sampler": fanfold.DistributedSampler(range(10), num_replicas=2, rank=0)})
    raise AssertionError(case)


@pytest.mark.parametrize("case, feature, kind", [
    ("DistributedDataParallel", "DistributedDataParallel", "all_reduce"),
    ("ZeRO stage 1 step", "ZeroRedundancyOptimizer", "all_gather"),
    ("ZeRO stage 2 step", "ZeroRedundancyOptimizer", "all_gather"),
    ("ZeRO stage 2 backward", "DistributedDataParallel", "reduce_scatter"),
    ("clip_grad_norm_", "clip_grad_norm_", "all_reduce"),
    ("Pipeline data parallelism", "Pipeline data parallelism", "all_reduce"),
    ("SyncBatchNorm", "SyncBatchNorm", "all_reduce"),
    ("fanfold.save", "fanfold.save", "all_gather"),
    ("fanfold.load", "fanfold.load", "all_gather"),
])
def test_a_rank_that_skips_the_feature_stalls_the_other_with_a_named_error(case, feature, kind, tmp_path):
    # start-up included, which a loaded machine makes slow; the stall itself is timed in the rank
    (r0, res0), (r1, res1) = _run_ranks(_skip_one, case, str(tmp_path / "ckpt.pt"), timeout=STALL + 240)
    assert (r0, r1, res1) == ("ok", "ok", "skipped"), (res0, res1)
    message, named, got_kind, missing, waited = res0
    assert waited < STALL + 20, waited  # the stall timeout with a margin for a loaded machine, not the group's 60 s
    assert (named, got_kind, missing) == (feature, kind, [1])
    assert message.startswith(f"rank 0 of 2: {feature}'s {kind} #")
    assert f"did not complete within {STALL:g} s. Ranks that never arrived: [1]." in message
