"""The job of the multi-host relay test (``test_relay_across_hosts.py``), run by ``fanfold run --nnodes 2``:
``init_process_group`` (env://: the job's authenticated store when the nodes share a secret), each rank's canary
written to the default store and read back by every other rank, an all-reduce checked against its sum.

    python relay_job.py OUT_DIR CANARY

Rank 0 first writes MASTER_ADDR:MASTER_PORT to ``OUT_DIR/master``: what an attacker learns from the open
rendezvous store. Each rank writes ``OUT_DIR/rank<R>.json`` (the canaries it read, the all-reduce's result).
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import fanfold  # noqa: F401 - the env:// rendezvous of the job's store


def main(out: str, canary: str) -> None:
    rank = int(os.environ["RANK"])
    if rank == 0:
        with open(os.path.join(out, "master.tmp"), "w") as f:
            f.write(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        os.rename(os.path.join(out, "master.tmp"), os.path.join(out, "master"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):  # the keys as they are, not under the group's prefix
        store = store.underlying_store
    store.set(f"canary/rank{rank}", f"{canary}-{rank}")
    read = [store.get(f"canary/rank{r}").decode() for r in range(world)]  # get waits for the key
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"read": read, "sum": total.item(), "world": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
