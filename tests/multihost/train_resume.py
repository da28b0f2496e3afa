"""A training script for ``fanfold run --nnodes 2 --max-restarts 1`` across simulated hosts: fanfold's DDP on the
``fanfold`` backend, the MLP of the DDP tests, a checkpoint after every step; a restarted run resumes from it.

    python train_resume.py OUT_DIR STEPS [--kill-at STEP]

With ``--kill-at``, the last rank kills itself (SIGKILL) in that step of the first attempt, after its forward; the
agent restarts every worker on both hosts. Rank 0 writes the final parameters to ``OUT_DIR/final.pt``.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared models

import fanfold  # noqa: E402
from _ddp_models import batch, loss_fn, mlp, optimizer, shard  # noqa: E402

GLOBAL_BATCH = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    opt = optimizer(model)
    ckpt = os.path.join(args.out_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.bufs, start = state["bufs"], state["step"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} of {world} on {os.uname().nodename}: attempt {attempt}, from step {start}", flush=True)
    ddp = fanfold.DistributedDataParallel(model)
    for step in range(start, args.steps):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        opt.zero_grad()
        loss = loss_fn("mlp", ddp(shard(x, rank, world)), shard(y, rank, world))
        if step == args.kill_at and attempt == 0 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        if rank == 0:  # written whole, then renamed: a restart never reads half a checkpoint
            torch.save({"model": model.state_dict(), "bufs": opt.bufs, "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()  # nobody runs ahead of the checkpoint of this step
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], os.path.join(args.out_dir, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
