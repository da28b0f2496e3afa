"""Start ranks like fanfold.launch, but let one die: the survivors run to their end and report through files.

fanfold.launch stops every rank once one fails (what a job wants); a test of what the survivors of a dead peer
see needs them to go on. Each rank runs ``fn(*args)`` and exits without tearing its process group down (that would
wait on the lost peer)."""
import multiprocessing as mp
import os
import time

import torch

from fanfold.distributed import free_port


def run_surviving(fn, args, nprocs, timeout=90):
    """Run ``fn(*args)`` on ``nprocs`` ranks of a loopback gloo job; wait (bounded) for all, kill any still
    running after ``timeout`` seconds; the exit codes by rank."""
    ctx = mp.get_context("forkserver")
    # the caller's environment as it is now (a test's FANFOLD_STALL_TIMEOUT included): the forkserver's children
    # inherit the environment of the moment the forkserver started, which an earlier test may have set otherwise
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nprocs)}
    procs = [ctx.Process(target=_rank_entry, args=(fn, args, r, env)) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _rank_entry(fn, args, r, env):
    os.environ.clear()
    os.environ.update(env, RANK=str(r), LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    fn(*args)
    os._exit(0)  # no process-group teardown: it would wait on the peer this scenario lost
