"""SyncBatchNorm under fanfold DistributedDataParallel on 2 and 3 gloo ranks, against plain BatchNorm applied to
the whole batch in one process: the first step's outputs and gradients, the parameters and running statistics
after 10 SGD steps. Even, uneven (5 + 3) and empty per-rank batches; join() with a rank that runs out two steps
early and with one that never has a batch; both transports; 2 DataParallel replicas in each rank; one collective
per layer in forward and in backward; the clear errors of join() on a shared process group, of no_sync() inside
join() and of replicas inside join()."""
import functools
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

import fanfold
from _syncbn_models import STEPS, assert_matches, cnn, oracle, part, part_loss, step_batch, train
from fanfold import SyncBatchNorm
from fanfold.collectives.transport import TorchTransport
from fanfold.distributed import init_process_group, rank, world_size

# schedule[step][r]: rank r's batch size at that step; None: rank r has run out (inside join() only)
EVEN = [[4, 4]] * STEPS
UNEVEN = [[5, 3]] * STEPS
EMPTY = [[6, 0] if s % 2 == 0 else [3, 5] for s in range(STEPS)]
JOIN = [[5, 3]] * (STEPS - 2) + [[5, None]] * 2
JOIN_NEVER = [[None, 4]] * 2
THREE = {"even3": [[4, 4, 4]] * STEPS, "uneven3": [[5, 3, 0]] * STEPS}


def _train(schedule, transport=None, join=False, count=False, replicas=None):
    r, world = rank(), world_size()
    torch.set_num_threads(1)
    model = SyncBatchNorm.convert_sync_batchnorm(cnn())
    inner = model
    if replicas is not None:  # each rank runs 2 DataParallel CPU replicas, backward in threads (True) or not
        inner = fanfold.DataParallel(model, device_ids=["cpu", "cpu"], parallel_backward=replicas)
    ddp = fanfold.DDP(inner, transport=transport)

    def batches():
        for step, sizes in enumerate(schedule):
            if sizes[r] is None:  # this rank has run out
                return
            active = [s or 0 for s in sizes]
            x, y = step_batch(step, sum(active))
            yield part(x, active, r), part(y, active, r), sum(active), world

    seen, depth = [], [0]  # (channel, length) of every float64 all-reduce: SyncBatchNorm's (DDP's are float32)

    def counted(channel, all_reduce):
        def call(t, *args, **kwargs):
            if t.dtype == torch.float64 and depth[0] == 0:  # not torch's under DDP's torch transport
                seen.append((channel, t.numel()))
            depth[0] += 1
            try:
                return all_reduce(t, *args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    all_reduce, torch_all_reduce = dist.all_reduce, TorchTransport.all_reduce
    channel = getattr(ddp.transport, "inner", ddp.transport)  # SyncBatchNorm uses the one under the inspector
    if count:
        # DDP's own transport first (its instance attribute wins over the class's), then any other: a layer's
        # own TorchTransport (inside join) calls its process group directly, so the class is where to count it
        channel.all_reduce = counted("DDP's transport", channel.all_reduce)
        dist.all_reduce = counted("torch.distributed", all_reduce)
        TorchTransport.all_reduce = lambda self, t, *args, **kwargs: counted(
            "torch.distributed", functools.partial(torch_all_reduce, self))(t, *args, **kwargs)
    try:
        with ddp.join() if join else nullcontext():
            rec = train(model, ddp, batches())
    finally:
        dist.all_reduce, TorchTransport.all_reduce = all_reduce, torch_all_reduce
        vars(channel).pop("all_reduce", None)
    # leaving join() gave every rank the last active rank's model
    rec["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rec["collectives"] = seen
    return rec


def _error_of(fn):
    try:
        fn()
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _join_on_shared_group():
    ddp = fanfold.DDP(SyncBatchNorm.convert_sync_batchnorm(cnn()), transport="torch")
    with ddp.join():
        pass


def _no_sync_inside_join():
    ddp = fanfold.DDP(SyncBatchNorm.convert_sync_batchnorm(cnn()), transport="shm", stall_timeout=5)
    with ddp.join():
        if rank() == 0:  # rank 1 has joined at once: it shadows rank 0, which then accumulates without sync
            x, y = step_batch(0, 4)
            with ddp.no_sync():
                part_loss(ddp(x), y, 4, 2).backward()


def _worker2():
    init_process_group(timeout=60)
    return {
        "even_torch": _train(EVEN, transport="torch", count=True),
        "uneven_shm": _train(UNEVEN, transport="shm", count=True),
        "empty": _train(EMPTY),
        "join": _train(JOIN, join=True, count=True),
        "join_never": _train(JOIN_NEVER, join=True),
        "replicas_threads": _train(UNEVEN, replicas=True),
        "replicas_engine": _train(UNEVEN, replicas=False),
        "replicas_join": _error_of(lambda: _train(JOIN, join=True, replicas=True)),
        "shared_group": _error_of(_join_on_shared_group),
        "no_sync": _error_of(_no_sync_inside_join),  # last: it leaves rank 1 after a stall
    }


def _worker3():
    init_process_group(timeout=60)
    return {name: _train(schedule) for name, schedule in THREE.items()}


@pytest.fixture(scope="module")
def two():
    return fanfold.launch(_worker2, nprocs=2, timeout=240)


@pytest.fixture(scope="module")
def three():
    return fanfold.launch(_worker3, nprocs=3, timeout=240)


def _check(results, key, schedule):
    want = oracle([[s for s in sizes if s is not None] for sizes in schedule])
    first = [s or 0 for s in schedule[0]]
    for r, rec in enumerate(results):
        got = rec[key]
        if "out0" in got:
            assert_matches(got, want, first, r)
        else:  # a rank that never trained: the model it ends with is the others'
            assert_matches({**got, "grads0": want["grads0"]}, want)
        for k, v in got["state"].items():  # every rank ends with the same bits
            assert torch.equal(v, results[0][key]["state"][k]), (key, r, k)


@pytest.mark.parametrize("key,schedule", [("even_torch", EVEN), ("uneven_shm", UNEVEN), ("empty", EMPTY),
                                          ("join", JOIN), ("join_never", JOIN_NEVER),
                                          ("replicas_threads", UNEVEN), ("replicas_engine", UNEVEN)])
def test_two_ranks_match_batchnorm_on_the_whole_batch(two, key, schedule):
    _check(two, key, schedule)


@pytest.mark.parametrize("key", sorted(THREE))
def test_three_ranks_match_batchnorm_on_the_whole_batch(three, key):
    _check(three, key, THREE[key])


def test_one_collective_per_layer_in_forward_and_in_backward(two):
    # [n*mean | n*E[x^2] | n] per layer in forward (8, 8, 16 channels), [sum(dy) | sum(dy*xhat)] in backward;
    # through DDP's transport (torch.distributed or shared memory), except inside join(): torch.distributed, and
    # the rank that ran out two steps early replays the same collectives for those steps
    step = [17, 17, 33, 32, 16, 16]
    for rec in two:
        for key, channel in (("even_torch", "DDP's transport"), ("uneven_shm", "DDP's transport"),
                             ("join", "torch.distributed")):
            assert rec[key]["collectives"] == [(channel, n) for n in step * STEPS], key


def test_join_refuses_a_process_group_shared_with_ddp(two):
    for rec in two:
        assert "share one process group" in rec["shared_group"] and "new_group" in rec["shared_group"]


def test_replicas_inside_join_are_refused(two):
    for rec in two:
        assert "DataParallel replicas inside DistributedDataParallel.join() are not supported" in rec["replicas_join"]


def test_no_sync_inside_join_raises_instead_of_hanging(two):
    assert "no_sync() inside DistributedDataParallel.join()" in two[0]["no_sync"]
    assert "rank(s) [1] have run out" in two[0]["no_sync"]
    assert two[1]["no_sync"].startswith("StallError")  # bounded: the shadowing rank gives up after stall_timeout


def _nccl_worker():
    dev = init_process_group(backend="nccl", timeout=60)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # float32 as the CPU oracle's
    model = SyncBatchNorm.convert_sync_batchnorm(cnn()).to(dev)
    ddp = fanfold.DDP(model, device_ids=[dev])
    sizes, r = [5, 3], rank()
    x, y = step_batch(0, 8)
    out = ddp(part(x, sizes, r).to(dev))
    part_loss(out, part(y, sizes, r).to(dev), 8, 2).backward()
    return {"out0": out.detach().cpu(), "grads0": [p.grad.cpu() for p in model.parameters()],
            "state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


@pytest.mark.gpu
def test_nccl_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: 2 GPUs")
    results = fanfold.launch(_nccl_worker, nprocs=2, timeout=240)
    want = oracle([[5, 3]])
    for r, got in enumerate(results):  # one step: the running statistics after one update
        torch.testing.assert_close(got["out0"], part(want["out0"], [5, 3], r), rtol=1e-4, atol=1e-5)
        for a, b in zip(got["grads0"], want["grads0"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
