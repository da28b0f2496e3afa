"""One rank of a stall-matrix case (``test_stall_matrix.py``), run as ``python _stall_program.py SETUP CASE DIR``
with the torchrun environment: a few steps of training with SETUP, where rank 1 (the culprit) deviates as CASE
says. Prints ``ENTERED <time>`` before each collective it may stall in, and ``RESULT <json>`` (the error it
raised, if any), then ends by a normal interpreter exit (process group teardown included): the test measures when
each process is gone."""
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import fanfold

STEPS = 3
EXIT_WARN_S = 5.0
WARM_STALL_S = 60.0


def entered(what):
    print(f"ENTERED {time.time()} {what}", flush=True)


def train(setup, case, path):
    rank = dist.get_rank()
    culprit = rank == 1
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with fanfold.stall_timeout(WARM_STALL_S):  # the set-up's collectives: as the steps before the case's, below
        if setup == "backend":
            model = nn.parallel.DistributedDataParallel(net)  # torch's own DDP on the fanfold backend
        else:
            model = fanfold.DistributedDataParallel(net, transport="torch" if setup == "ddp-torch" else "shm")
        if setup == "zero":
            opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        last = step == STEPS - 1
        # the steps before the case's run under a generous stall timeout: on a loaded machine a rank's first steps
        # (lazy imports, first calls) can take longer than the 3 s under test, which would end an earlier
        # collective instead of the case's
        with contextlib.nullcontext() if last else fanfold.stall_timeout(WARM_STALL_S):
            _step(model, opt, setup, case, culprit, last, step, path)
    if case == "skip_to_dist_barrier":
        entered("dist.barrier")
        dist.barrier()  # torch's own, on the gloo group where rank 0 still waits in its last backward's all_reduce
    if case == "missing_barrier" and not culprit or case == "missing_save" and culprit:
        entered("barrier")
        model.transport.barrier()
    if case != "missing_save" or not culprit:
        entered("save")
        fanfold.save(path, {"model": net.state_dict()})


def _step(model, opt, setup, case, culprit, last, step, path):
    if case == "killed" and culprit and last:
        entered("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    if case == "store_frozen_killed" and culprit and last:
        entered("freeze the store")  # the test stops the store's process, then says so with a file
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(os.path.dirname(path), "frozen")) and time.monotonic() < end:
            time.sleep(0.01)
        entered("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    if case == "extra_all_reduce" and culprit and last:
        entered("extra all_reduce")
        dist.all_reduce(torch.ones(1))  # the user's own, one the other ranks never issue
    if case in ("skip_backward", "skip_to_dist_barrier") and culprit and last:
        return
    entered(f"backward {step}")
    loss.backward()
    opt.step()
    opt.zero_grad()


def main(setup, case, folder):
    torch.set_num_threads(1)
    dist.init_process_group("fanfold" if setup == "backend" else "gloo", timeout=timedelta(seconds=60))
    # One step on a local copy first, no collective in it: a process's first forward and backward (autograd's
    # threads, the kernels' first calls) can take seconds of a loaded machine's CPU, longer than the stall timeout
    # under test, which would then end the first collective instead of the case's.
    warm = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    warm(torch.randn(8, 4)).pow(2).mean().backward()
    # Every rank starts training together: on a loaded machine a rank may start seconds after the others.
    store = dist.distributed_c10d._get_default_store()
    store.add("stall-matrix/started", 1)
    deadline = time.monotonic() + 60
    while store.add("stall-matrix/started", 0) < dist.get_world_size():
        assert time.monotonic() < deadline, "the other ranks never started"
        time.sleep(0.01)
    result = {}
    try:
        train(setup, case, os.path.join(folder, "ckpt.pt"))
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        result = {"type": type(exc).__name__, "message": str(exc), "missing": getattr(exc, "missing", None),
                  "feature": getattr(exc, "feature", None)}
    print("RESULT " + json.dumps(result), flush=True)
    print(f"REPORTED {time.time()}", flush=True)  # what follows is the interpreter's exit
    # an exit that takes long prints where it waits (the test bounds it), then goes on
    faulthandler.dump_traceback_later(EXIT_WARN_S, exit=False)
    return 1 if result else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
