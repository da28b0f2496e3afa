"""Data-parallel training in one file: fanfold's DistributedDataParallel on a small MLP, synthetic data, CPU or GPU.

Run it (from the repository root):

    python examples/train_ddp.py                                    # 1 process, no process group
    fanfold run -n 2 examples/train_ddp.py                          # 2 processes on this machine
    fanfold run -n 2 examples/train_ddp.py --steps 100 --lr 0.05    # script arguments pass through untouched
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_ddp.py   # torchrun works too

On 2 machines with 4 processes each, run on both (node0 = the first machine's address, reachable from the other):

    fanfold run -n 4 --nnodes 2 --rdzv-id job1 --rdzv-endpoint node0:29400 examples/train_ddp.py
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-id job1 --rdzv-endpoint node0:29400 \\
        examples/train_ddp.py

The distributed set-up is the launcher's environment only (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
``fanfold.distributed.init_process_group()`` reads it, picks NCCL with CUDA and gloo otherwise, and pins this process
to its local device. The model is wrapped late (after it is built and moved) and unwrapped once, for the check.

Every rank draws the same global batch for a step and trains on its own slice of it, so N processes with
``--batch-size B`` follow the same trajectory as one process with batch N x B. The script checks its own result and
exits non-zero when a check fails: the loss on a held-out batch falls, the parameters are identical on every rank,
and (``--check``, on by default) they equal a single-process replay of the same steps on the full global batches.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fanfold
import fanfold.distributed


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))


def global_batch(step: int, size: int, seed: int, teacher: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of a synthetic task (labels from a fixed random teacher): the same on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size, 32, generator=g)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    return x, y


def train(model: nn.Module, steps: int, lr: float, batch: int, rank: int, world: int, seed: int,
          teacher: nn.Module, device: torch.device, log: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step, batch * world, seed, teacher)
        x, y = x[rank * batch:(rank + 1) * batch].to(device), y[rank * batch:(rank + 1) * batch].to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # under DDP: gradients averaged over ranks, bucket by bucket, during backward
        opt.step()
        if log and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


def eval_loss(model: nn.Module, seed: int, teacher: nn.Module, device: torch.device) -> float:
    x, y = global_batch(-1, 1024, seed, teacher)
    with torch.no_grad():
        return F.cross_entropy(model(x.to(device)), y.to(device)).item()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare with a single-process replay on the full global batches (default on)")
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # set by fanfold run / torchrun; absent for `python train_ddp.py`
    device = fanfold.distributed.init_process_group(timeout=120) if distributed else torch.device("cpu")
    rank, world = fanfold.distributed.rank(), fanfold.distributed.world_size()
    main_process = fanfold.distributed.is_main_process()
    if main_process:
        print(f"{world} process(es), device {device}, {args.batch_size} samples per process and step", flush=True)

    teacher = make_model(seed=1000 + args.seed)
    model = make_model(args.seed).to(device)
    start = flat(model)
    if distributed:
        model = fanfold.DistributedDataParallel(model, device_ids=[device] if device.type != "cpu" else None)
    before = eval_loss(model, args.seed, teacher, device)
    train(model, args.steps, args.lr, args.batch_size, rank, world, args.seed, teacher, device, main_process)
    after = eval_loss(model, args.seed, teacher, device)
    net = model.module if distributed else model  # unwrap once

    failures = []
    if not after < 0.8 * before:
        failures.append(f"held-out loss did not fall enough: {before:.4f} -> {after:.4f}")
    mine = flat(net)
    if distributed:
        ref = mine.clone()
        dist.broadcast(ref, src=0)
        differs = torch.tensor([0.0 if torch.equal(ref, mine) else 1.0])
        dist.all_reduce(differs)  # every rank learns the verdict, so all of them exit the same way
        if differs.item():
            failures.append(f"parameters differ from rank 0's on {int(differs.item())} rank(s)")
    if args.check and main_process:
        replay = make_model(args.seed)
        assert torch.equal(flat(replay), start)
        train(replay, args.steps, args.lr, args.batch_size * world, 0, 1, args.seed, teacher, torch.device("cpu"),
              False)
        if not torch.allclose(mine, flat(replay), rtol=1e-4, atol=1e-5):
            gap = (mine - flat(replay)).abs().max().item()
            failures.append(f"parameters differ from the single-process replay by up to {gap:.3g}")
    if main_process:
        print(f"held-out loss {before:.4f} -> {after:.4f}; " + ("FAILED: " + "; ".join(failures) if failures else "ok"))
    if distributed:
        fanfold.distributed.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
