"""The main job's worker (``fanfold train``): a small CNN learns scikit-learn's digits with fanfold's DDP, sampler and
checkpoints, one process per rank. docs/main-job.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from ..collectives.stall import group_transport
from ..distributed.ddp import DistributedDataParallel
from ..distributed.env import destroy_process_group, init_process_group
from ..nn import SyncBatchNorm
from .checkpoint import load, save
from .data import DistributedSampler, gather_evaluation

CHECKPOINT = "checkpoint.pt"
# 1797 digits = 1440 to train + 357 held out: 1440 splits evenly over 2, 3, 4, 5, 6 or 8 ranks, so training needs no
# padding (every sample once an epoch), while 357 is odd and shows the exact evaluation count.
TEST_SIZE = 357
SPLIT_SEED = 0  # the split never depends on --seed: runs with different seeds are evaluated on the same samples
# hyperparameters a checkpoint is bound to; on/off switches (--sync-bn) are recorded only when on
RUN_KEYS = ("epochs", "batch_size", "lr", "seed")
RUN_FLAGS = ("sync_bn",)
RUN_DEFAULTS = {"epochs": 10, "batch_size": 64, "lr": 1e-2, "seed": 0, "sync_bn": False}


def draws_bars(stream) -> bool:
    """True when ``stream`` is a terminal of some width (not a pseudo-terminal nobody sized, as under ``script``)."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except OSError:
        return False


def saved_settings(ckpt: Path) -> dict:
    """The run settings a checkpoint was trained with, read without touching any model, generator or group."""
    saved = load(ckpt, {"run": {}}, rng=False).get("run")
    if not isinstance(saved, dict) or not set(RUN_KEYS) <= set(saved) <= set(RUN_KEYS) | set(RUN_FLAGS):
        raise ValueError(f"{ckpt} holds no run settings {list(RUN_KEYS)}: not written by fanfold train")
    return saved


def digits():
    """(train, test) TensorDatasets of (image 1x8x8 in [0, 1], label, sample id); the split is fixed."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    # ids are positions within each split: the evaluation (and the tests' sample ledger) count them
    return tuple(TensorDataset(images[i], labels[i], torch.arange(len(i))) for i in (train, test))


def make_model(batch_norm: bool = False):
    """Two 3x3 convolutions and two linear layers: ~38k parameters, > 0.97 test accuracy in a few seconds;
    ``batch_norm``: a BatchNorm2d after each convolution (``--sync-bn`` converts them to SyncBatchNorm)."""

    def norm(channels: int) -> list:
        return [nn.BatchNorm2d(channels)] if batch_norm else []

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), *norm(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), *norm(32), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10),
    )


def run_worker(args: argparse.Namespace) -> int:
    """One rank: build, maybe resume, train, checkpoint, evaluate exactly; rank 0 reports and plots."""
    torch.set_num_threads(1)  # one thread per rank: fixed reduction order inside each op, no oversubscription
    dev = init_process_group(timeout=120.0)  # the local accelerator when there is one, else the CPU
    if dev.type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    transport = group_transport(None, "fanfold train")  # the loss curve's all-reduce and the final barrier
    rank, world = transport.rank, transport.world_size
    out = Path(args.out)
    ckpt = out / CHECKPOINT
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {world} processes")

    train_set, test_set = digits()
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    net = make_model(batch_norm=args.sync_bn)
    if args.sync_bn:
        net = SyncBatchNorm.convert_sync_batchnorm(net)
    model = DistributedDataParallel(net.to(dev))
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    # its own generator: a DataLoader draws a seed at every iter(), and a resumed epoch is one iter() more
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, generator=torch.Generator())
    steps_per_epoch = len(loader)
    total = args.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total)
    run = {k: getattr(args, k) for k in RUN_KEYS} | {k: True for k in RUN_FLAGS if getattr(args, k, False)}
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
             "step": 0, "losses": [], "run": run}
    # after a restart by the launcher the workers start afresh: the checkpoint, if any, is where they left off
    resumed = ckpt.exists()
    if resumed:
        if saved_settings(ckpt) != run:  # only if the file changed under us: the parent checked it
            raise ValueError(f"{ckpt} belongs to a run with other settings than {run}")
        state.update(load(ckpt, state))
    step, losses = state["step"], state["losses"]
    if rank == 0 and resumed:  # --resume, or a restart by the launcher: say where the run picks up
        print(f"fanfold train: resumed from {ckpt} at step {step} of {total}", file=sys.stderr, flush=True)
    show = rank == 0
    plain = show and not draws_bars(sys.stderr)

    def checkpoint() -> None:
        save(ckpt, {**state, "step": step, "losses": losses})

    model.train()
    while step < total:
        epoch = step // steps_per_epoch
        bar = tqdm(total=steps_per_epoch, initial=step % steps_per_epoch, disable=plain or not show, unit="step",
                   desc=f"epoch {epoch + 1}/{args.epochs}", mininterval=0.5, dynamic_ncols=True)
        start, seen = time.perf_counter(), 0
        for x, y, ids in loader:  # the sampler resumes mid-epoch by itself and moves on to the next epoch
            loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            # the curve shows the global batch's loss, not rank 0's share
            losses.append(transport.all_reduce_now(loss.detach().clone()).item() / world)
            if step % steps_per_epoch == 0 or (args.checkpoint_every and step % args.checkpoint_every == 0):
                checkpoint()
            seen += len(ids) * world
            bar.set_postfix({"loss": f"{losses[-1]:.4f}",
                             "samples/s": f"{seen / (time.perf_counter() - start):.0f}"}, refresh=False)
            bar.update()
        bar.close()
        if plain:
            print(f"epoch {epoch + 1}/{args.epochs}: step {step}/{total}, loss {losses[-1]:.4f}, "
                  f"{seen / (time.perf_counter() - start):.0f} samples/s", file=sys.stderr, flush=True)

    correct, count = _evaluate(model, test_set, dev)
    if rank == 0:
        accuracy = correct / count
        print(f"test accuracy: {accuracy:.4f} ({correct}/{count} held-out digits, each counted once)", flush=True)
        (out / "metrics.json").write_text(json.dumps({"test_accuracy": accuracy, "test_samples": count,
                                                      "steps": step, "world_size": world}) + "\n")
        _plot(losses, steps_per_epoch, accuracy, out / "loss.png")
    transport.barrier()
    destroy_process_group()
    return 0


def _evaluate(model, test_set, dev) -> tuple[int, int]:
    """Every held-out sample exactly once: ``even=False`` pads nothing, the gather puts each result in its place."""
    sampler = DistributedSampler(test_set, shuffle=False, even=False)
    model.eval()
    hits = []
    with torch.no_grad():
        for x, y, _ in DataLoader(test_set, batch_size=256, sampler=sampler):
            hits.append(model(x.to(dev)).argmax(1) == y.to(dev))
    results = gather_evaluation(torch.cat(hits), sampler)
    return int(results.sum()), len(results)


def _plot(losses: list[float], steps_per_epoch: int, accuracy: float, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global figure state, the Agg canvas renders the PNG

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="global batch loss")
    per_epoch = [sum(losses[i:i + steps_per_epoch]) / len(losses[i:i + steps_per_epoch])
                 for i in range(0, len(losses), steps_per_epoch)]
    ax.plot([steps_per_epoch * (e + 1) for e in range(len(per_epoch))], per_epoch, "o-", label="epoch mean")
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy", title=f"digits CNN: test accuracy {accuracy:.4f}")
    ax.legend()
    fig.savefig(path, dpi=120)
