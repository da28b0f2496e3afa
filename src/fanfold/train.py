"""``fanfold train``: the main job. A small CNN learns scikit-learn's digits, data-parallel over N local processes.

Sits on top of every layer: the parent process starts N workers through ``fanfold run`` (``launch_script``); each
worker is this module run as ``python -m fanfold.train --worker ...`` and uses fanfold's own pieces only:
``init_process_group``, ``DistributedDataParallel``, ``DistributedSampler`` (exact resume; ``even=False`` for the
evaluation) and ``save``/``load`` (atomic, per-rank RNG). It is also the README's training-loop pattern, for real.

    fanfold train                                   # 2 processes on a CPU-only machine, runs/<timestamp>/
    fanfold train --devices 4 --epochs 5 --out runs/a
    fanfold train --out runs/a --resume             # continue from runs/a/checkpoint.pt, mid-epoch, exactly
    fanfold train --max-restarts 2                  # a killed worker costs at most --checkpoint-every steps
    fanfold train --sync-bn                         # BatchNorm after each convolution, over the global batch

Same seed, same parameters, bitwise: one torch thread per rank, the data order is a function of (seed, epoch) only,
the gradient sum over ranks is the same every run, and the checkpoint holds everything the next step depends on.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

CHECKPOINT = "checkpoint.pt"
# 1797 digits = 1440 to train + 357 held out: 1440 splits evenly over 2, 3, 4, 5, 6 or 8 ranks, so training needs no
# padding (every sample once an epoch), while 357 is odd and shows the exact evaluation count.
TEST_SIZE = 357
SPLIT_SEED = 0  # the split never depends on --seed: runs with different seeds are evaluated on the same samples
# Hyperparameters a checkpoint is bound to: resuming with other values would not continue the same run.
_RUN_KEYS = ("epochs", "batch_size", "lr", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="worker processes (default: one per GPU, or 2 on a CPU-only machine)")
    parser.add_argument("--epochs", type=int, default=10, metavar="E",
                        help="passes over the 1440 training digits (default 10)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="B",
                        help="global batch size, split evenly over the processes (default 64)")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle schedule")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights, the dropout and the data order")
    parser.add_argument("--out", default=None, metavar="DIR", help="run directory (default runs/<timestamp>)")
    parser.add_argument("--resume", action="store_true", help=f"continue from --out/{CHECKPOINT}")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart all workers up to K times after a failure; they resume from the checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS",
                        help="also checkpoint every STEPS optimizer steps, not only at epoch ends (0: epoch ends)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="add BatchNorm after each convolution, synchronised over the processes "
                             "(fanfold.SyncBatchNorm: statistics of the global batch)")
    # Internal and test-only flags: the worker entry, the per-rank sample ledger, a SIGKILL after a given step.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ledger", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    try:
        _check(args)
        if args.worker:
            return _worker(args)
        return _launch(args)
    except ValueError as exc:
        print(f"fanfold train: error: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    if args.devices is not None and args.batch_size % args.devices:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over --devices {args.devices}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.max_restarts < 0 or args.checkpoint_every < 0:
        raise ValueError("--max-restarts and --checkpoint-every must be >= 0")


def _launch(args: argparse.Namespace) -> int:
    """The parent: check the run directory, then start the workers through the launcher and wait for them."""
    from .launcher import default_nproc_per_node, launch_script

    if args.devices is None:
        args.devices = default_nproc_per_node()
        _check(args)
    out = Path(args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    ckpt = out / CHECKPOINT
    if args.resume and not ckpt.is_file():
        raise ValueError(f"--resume: no checkpoint at {ckpt}")
    if not args.resume and ckpt.exists():
        raise ValueError(f"--out {out} already holds {CHECKPOINT}: pass --resume, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["fanfold.train", "--worker", "--out", str(out), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--lr", repr(args.lr), "--seed", str(args.seed),
           "--checkpoint-every", str(args.checkpoint_every), "--devices", str(args.devices)]
    if args.ledger:
        cmd.append("--ledger")
    if args.sync_bn:
        cmd.append("--sync-bn")
    if args.kill_at_step is not None:
        cmd += ["--kill-at-step", str(args.kill_at_step)]
    code = launch_script(cmd, nproc_per_node=args.devices, max_restarts=args.max_restarts, module=True)
    if code == 0:
        print(f"fanfold train: wrote {ckpt} and {out / 'loss.png'}")
    else:
        print(f"fanfold train: workers failed (exit code {code}); continue with: "
              f"fanfold train --out {out} --resume", file=sys.stderr)
    return code


def digits():
    """(train, test) TensorDatasets of (image 1x8x8 in [0, 1], label, sample id); the split is fixed."""
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    # ids are positions within each split: the ledger and the evaluation count them
    return tuple(TensorDataset(images[i], labels[i], torch.arange(len(i))) for i in (train, test))


def make_model(batch_norm: bool = False):
    """Two 3x3 convolutions and two linear layers: ~38k parameters, > 0.97 test accuracy in a few seconds.
    ``batch_norm``: a BatchNorm2d after each convolution (``--sync-bn`` converts them to SyncBatchNorm).

    The dropout draws from each rank's torch generator: the checkpoint's per-rank RNG states keep a resume exact.
    """
    from torch import nn

    def norm(channels: int) -> list:
        return [nn.BatchNorm2d(channels)] if batch_norm else []

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), *norm(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), *norm(32), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10),
    )


def _worker(args: argparse.Namespace) -> int:
    """One rank: build, maybe resume, train, checkpoint, evaluate exactly; rank 0 reports and plots."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from .checkpoint import load, save
    from .data import DistributedSampler
    from .distributed.ddp import DistributedDataParallel
    from .distributed.env import destroy_process_group, init_process_group
    from .nn import SyncBatchNorm

    torch.set_num_threads(1)  # one thread per rank: fixed reduction order inside each op, no oversubscription
    dev = init_process_group(timeout=120.0)  # the local accelerator when there is one, else the CPU
    if dev.type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    rank, world = dist.get_rank(), dist.get_world_size()
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
    # Its own generator: a DataLoader draws a seed at every iter(), and a resumed epoch is one iter() more, so
    # drawing from the global generator would shift the dropout masks after a resume.
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, generator=torch.Generator())
    steps_per_epoch = len(loader)
    total = args.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total)
    run = {k: getattr(args, k) for k in _RUN_KEYS}
    if args.sync_bn:  # recorded only when set: checkpoints of runs without it stay resumable
        run["sync_bn"] = True
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
             "step": 0, "losses": [], "run": run}
    # After a restart by the launcher the workers start afresh: the checkpoint, if any, is where they left off.
    # (The parent refused a --out that already held one unless --resume was given.)
    if ckpt.exists():
        state.update(load(ckpt, state))
        if state["run"] != run:
            diff = {k: (state["run"][k], run[k]) for k in run if state["run"].get(k) != run[k]}
            raise ValueError(f"{ckpt} belongs to a run with other settings (saved, given): {diff}")
    step, losses = state["step"], state["losses"]
    ledger = _ledger(out, rank, world, step) if args.ledger else None

    def checkpoint() -> None:
        save(ckpt, {**state, "step": step, "losses": losses})

    model.train()
    while step < total:
        epoch = step // steps_per_epoch
        bar = tqdm(total=steps_per_epoch, initial=step % steps_per_epoch, disable=rank != 0, unit="step",
                   desc=f"epoch {epoch + 1}/{args.epochs}", mininterval=0.5, dynamic_ncols=True)
        start, seen = time.perf_counter(), 0
        for x, y, ids in loader:  # the sampler resumes mid-epoch by itself and moves on to the next epoch
            loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the curve shows the global batch's loss, not rank 0's share
            losses.append(mean.item() / world)
            if ledger:
                print(step, epoch, *ids.tolist(), file=ledger, flush=True)
            if step % steps_per_epoch == 0 or (args.checkpoint_every and step % args.checkpoint_every == 0):
                checkpoint()
            if step == args.kill_at_step and rank == world - 1:
                _kill_once(out, step)
            seen += len(ids) * world
            bar.set_postfix({"loss": f"{losses[-1]:.4f}",
                             "samples/s": f"{seen / (time.perf_counter() - start):.0f}"}, refresh=False)
            bar.update()
        bar.close()
        if step % steps_per_epoch:
            raise RuntimeError(f"rank {rank}: the sampler ended epoch {epoch} after step {step}, "
                               f"not on a multiple of {steps_per_epoch} steps")
    if ledger:
        ledger.close()

    correct, count = _evaluate(model, test_set, dev)
    if rank == 0:
        accuracy = correct / count
        print(f"test accuracy: {accuracy:.4f} ({correct}/{count} held-out digits, each counted once)", flush=True)
        (out / "metrics.json").write_text(json.dumps({"test_accuracy": accuracy, "test_samples": count,
                                                      "steps": step, "world_size": world}) + "\n")
        _plot(losses, steps_per_epoch, accuracy, out / "loss.png")
    dist.barrier()
    destroy_process_group()
    return 0


def _evaluate(model, test_set, dev) -> tuple[int, int]:
    """Every held-out sample exactly once: ``even=False`` pads nothing, the gather puts each result in its place."""
    import torch
    from torch.utils.data import DataLoader

    from .data import DistributedSampler, gather_evaluation

    sampler = DistributedSampler(test_set, shuffle=False, even=False)
    model.eval()
    hits = []
    with torch.no_grad():
        for x, y, _ in DataLoader(test_set, batch_size=256, sampler=sampler):
            hits.append(model(x.to(dev)).argmax(1) == y.to(dev))
    results = gather_evaluation(torch.cat(hits), sampler)
    if len(results) != len(test_set):
        raise RuntimeError(f"evaluation counted {len(results)} samples, the held-out split has {len(test_set)}")
    return int(results.sum()), len(results)


def _ledger(out: Path, rank: int, world: int, step: int):
    """Rank's record of the sample ids it trained on, one line per step; lines after ``step`` are rolled back.

    Those steps were lost with the killed run and are trained again, so they are recorded again. Rank 0 also rolls
    back the records of ranks that a run resumed on fewer processes no longer has.
    """
    paths = [out / f"ledger-rank{rank}.txt"]
    if rank == 0:
        paths += [p for p in out.glob("ledger-rank*.txt") if int(p.stem.removeprefix("ledger-rank")) >= world]
    for path in paths:
        if path.exists():
            kept = [ln for ln in path.read_text().splitlines() if ln.split() and int(ln.split()[0]) <= step]
            path.write_text("".join(ln + "\n" for ln in kept))
    return paths[0].open("a")


def _kill_once(out: Path, step: int) -> None:
    """Test hook: die as a crash would (SIGKILL, no clean-up), once per run directory."""
    marker = out / f"killed-at-step-{step}"
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


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


if __name__ == "__main__":  # the worker entry: python -m fanfold.train --worker ...
    _parser = argparse.ArgumentParser(prog="python -m fanfold.train")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
