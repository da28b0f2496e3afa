"""``fanfold train``: the main job, a small CNN learning scikit-learn's digits over N processes. The parent checks the
flags and the run directory and starts N workers (``launch_script``), each running this module with ``--worker``
(``fanfold.training.job.run_worker``). Every flag: docs/main-job.md."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from ..launcher.agent import default_nproc_per_node, launch_script
from ..training.checkpoint import CheckpointError
from ..training.job import CHECKPOINT, RUN_DEFAULTS, RUN_FLAGS, RUN_KEYS, run_worker, saved_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RUN_DEFAULTS
    saved = ", or the checkpoint's with --resume"
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="worker processes (default: one per GPU, or 2 on a CPU-only machine)")
    parser.add_argument("--epochs", type=int, default=None, metavar="E",
                        help=f"passes over the 1440 training digits (default: {d['epochs']}{saved})")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help=f"global batch size, split evenly over the processes (default: {d['batch_size']}{saved})")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"peak learning rate of the one-cycle schedule (default: {d['lr']}{saved})")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"seeds the initial weights, the dropout and the data order (default: {d['seed']}{saved})")
    parser.add_argument("--out", default=None, metavar="DIR", help="run directory (default: runs/<timestamp>)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue the run in --out from its {CHECKPOINT}, with its settings")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart all workers up to K times after a failure; they resume from the checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS",
                        help="also checkpoint every STEPS optimizer steps, not only at epoch ends (0: epoch ends)")
    parser.add_argument("--sync-bn", action="store_true", default=None,
                        help="add BatchNorm after each convolution, synchronised over the processes "
                             f"(fanfold.SyncBatchNorm: statistics of the global batch; off by default{saved})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the workers' entry


def main(args: argparse.Namespace) -> int:
    try:
        if args.worker:  # the parent checked the flags
            return run_worker(args)
        return _launch(args)
    except (ValueError, CheckpointError) as exc:
        # a refused checkpoint (corrupted, truncated, foreign, pickled code) is a refusal like any other: one line
        print(f"fanfold train: error: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size", "devices"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size % args.devices:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over --devices {args.devices}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.max_restarts < 0 or args.checkpoint_every < 0:
        raise ValueError("--max-restarts and --checkpoint-every must be >= 0")


def _setting(key: str, value: object) -> str:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):  # a switch (--sync-bn): on or off
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def _settings(args: argparse.Namespace, ckpt: Path) -> None:
    """Fill the run settings not given: the defaults, or with --resume the checkpoint's; refuse changed ones before
    any worker starts (they would not continue the same run)."""
    keys = RUN_KEYS + RUN_FLAGS
    # a flag the checkpoint does not record was off
    saved = ({k: False for k in RUN_FLAGS} | saved_settings(ckpt)) if args.resume else RUN_DEFAULTS
    changed = [key for key in keys if args.resume and getattr(args, key) not in (None, saved[key])]
    if changed:
        given = " ".join(_setting(k, getattr(args, k)) for k in changed)
        was = ", ".join(_setting(k, saved[k]) for k in changed)
        advice = f"fanfold train --out {shlex.quote(str(ckpt.parent))} --resume"
        raise ValueError(f"--resume: {ckpt} was trained with {was}; {given} would not continue that run. "
                         f"Continue it with its own settings: {advice} (or start a new run with another --out)")
    for key in keys:
        if getattr(args, key) is None:
            setattr(args, key, saved[key])


def _launch(args: argparse.Namespace) -> int:
    # scikit-learn (the digits) and matplotlib (the plot) are the train extra, not fanfold's dependencies: say so
    # here rather than in a traceback from every worker
    missing = [pip for module, pip in (("sklearn", "scikit-learn"), ("matplotlib", "matplotlib"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"the main job needs {' and '.join(missing)}, which fanfold alone does not install: "
                         f"pip install 'fanfold[train]' (or `make run`, which installs them)")
    out = Path(args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    ckpt = out / CHECKPOINT
    if args.resume and not ckpt.is_file():
        raise ValueError(f"--resume: no checkpoint at {ckpt}")
    if not args.resume and ckpt.exists():
        raise ValueError(f"--out {out} already holds {CHECKPOINT}: pass --resume, or choose another --out")
    _settings(args, ckpt)
    if args.devices is None:
        args.devices = default_nproc_per_node()
    _check(args)
    created = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["fanfold.cli.train", "--worker", "--out", str(out), *(["--sync-bn"] if args.sync_bn else [])]
    for key in (*RUN_KEYS, "checkpoint_every", "devices"):
        cmd += ["--" + key.replace("_", "-"), repr(getattr(args, key))]
    # The workers need a few seconds (torch, the digits, the process group) before their first line: say so now.
    what = f"resuming {ckpt}" if args.resume else f"writing to {out}"
    try:
        print(f"fanfold train: starting {args.devices} worker processes, {what}; the first epoch line follows once "
              f"they have started (about 5-20 s)", file=sys.stderr, flush=True)
        code = launch_script(cmd, nproc_per_node=args.devices, max_restarts=args.max_restarts, module=True)
    except KeyboardInterrupt:  # Ctrl-C before the agent took over the signals (no worker had started)
        code = 128 + signal.SIGINT
    advice = f"fanfold train --out {shlex.quote(str(out))} --resume"
    what = {128 + signal.SIGINT: "interrupted (Ctrl-C)", 128 + signal.SIGTERM: "stopped (SIGTERM)"}.get(
        code, f"workers failed (exit code {code})")
    if code == 0:
        tidy = "" if args.out else " (runs/ keeps every run: `rm -r runs` removes them all)"
        print(f"fanfold train: wrote {ckpt} and {out / 'loss.png'}{tidy}")
    elif ckpt.is_file():
        print(f"fanfold train: {what}; continue with: {advice}", file=sys.stderr)
    else:
        # nothing to resume: the folders this run made and left empty would only mislead
        for d in created:
            try:
                d.rmdir()
            except OSError:  # not empty (something else wrote there), or already gone
                break
        gone = f"; removed the empty {out}" if created and not out.exists() else ""
        print(f"fanfold train: {what} before the first checkpoint: nothing to resume{gone}", file=sys.stderr)
    return code


if __name__ == "__main__":  # the worker entry: python -m fanfold.cli.train --worker ...
    _parser = argparse.ArgumentParser(prog="python -m fanfold.cli.train")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
