"""``fanfold train``: the main job's command. A small CNN learns scikit-learn's digits, data-parallel over N processes.

The parent checks the flags and the run directory, then starts N workers through ``fanfold.launcher``
(``launch_script``); each worker is this module run as ``python -m fanfold.cli.train --worker ...`` and calls
``fanfold.training.job.run_worker``.

    fanfold train                                   # 2 processes on a CPU-only machine, runs/<timestamp>/
    fanfold train --devices 4 --epochs 5 --out runs/a
    fanfold train --out runs/a --resume             # continue from runs/a/checkpoint.pt, mid-epoch, exactly
    fanfold train --max-restarts 2                  # a killed worker costs at most --checkpoint-every steps
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..launcher.agent import default_nproc_per_node, launch_script
from ..training.job import CHECKPOINT, run_worker


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
    # Internal and test-only flags: the worker entry, the per-rank sample ledger, a SIGKILL after a given step.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ledger", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    try:
        _check(args)
        if args.worker:
            return run_worker(args)
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
    cmd = ["fanfold.cli.train", "--worker", "--out", str(out), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--lr", repr(args.lr), "--seed", str(args.seed),
           "--checkpoint-every", str(args.checkpoint_every), "--devices", str(args.devices)]
    if args.ledger:
        cmd.append("--ledger")
    if args.kill_at_step is not None:
        cmd += ["--kill-at-step", str(args.kill_at_step)]
    code = launch_script(cmd, nproc_per_node=args.devices, max_restarts=args.max_restarts, module=True)
    if code == 0:
        print(f"fanfold train: wrote {ckpt} and {out / 'loss.png'}")
    else:
        print(f"fanfold train: workers failed (exit code {code}); continue with: "
              f"fanfold train --out {out} --resume", file=sys.stderr)
    return code


if __name__ == "__main__":  # the worker entry: python -m fanfold.cli.train --worker ...
    _parser = argparse.ArgumentParser(prog="python -m fanfold.cli.train")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
