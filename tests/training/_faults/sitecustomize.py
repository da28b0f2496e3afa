"""Test-only fault injection for `fanfold train`'s workers (tests/training/test_train.py); not part of fanfold.

The test puts this folder on PYTHONPATH of the runs it starts, so Python runs this ``sitecustomize`` at the start
of every process of the run. With FANFOLD_TEST_LEDGER=1, FANFOLD_TEST_KILL_AT_STEP=S or FANFOLD_TEST_PAUSE_AT_STEP=S
set, it waits for
``fanfold.training.job`` to be imported and wraps three of its names, leaving the product code untouched:

- ``run_worker``, to learn the run directory; ``load``, to learn the step a worker resumes from;
- ``DataLoader``: the training loader's iterator. Fetching batch s+1 means step s is complete (optimizer step and
  any checkpoint included), so that is when step s is recorded in ``ledger-rank<R>.txt`` (``step epoch ids...``)
  and when the last rank SIGKILLs itself after step S, as a crash would (once per run directory), or rank 0 pauses
  after step S (writing ``paused-at-step-S``) so that the test can interrupt the run at a known point.

A resumed worker rolls back the ledger lines of the steps the crash lost (they are trained, and recorded, again);
rank 0 also rolls back those of ranks that a run resumed on fewer processes no longer has.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time
from pathlib import Path

_TARGET = "fanfold.training.job"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _roll_back(out: Path, rank: int, world: int, step: int):
    paths = [out / f"ledger-rank{rank}.txt"]
    if rank == 0:
        paths += [p for p in out.glob("ledger-rank*.txt") if int(p.stem.removeprefix("ledger-rank")) >= world]
    for path in paths:
        if path.exists():
            kept = [ln for ln in path.read_text().splitlines() if ln.split() and int(ln.split()[0]) <= step]
            path.write_text("".join(ln + "\n" for ln in kept))
    return paths[0].open("a")


def _patch(job) -> None:
    ledger_on = os.environ.get("FANFOLD_TEST_LEDGER") == "1"
    kill_at = int(os.environ.get("FANFOLD_TEST_KILL_AT_STEP", "0"))
    pause_at = int(os.environ.get("FANFOLD_TEST_PAUSE_AT_STEP", "0"))
    run = {"step": 0, "out": None, "ledger": None}
    run_worker, load, loader_cls = job.run_worker, job.load, job.DataLoader

    def patched_run_worker(args):
        run["out"] = Path(args.out)
        return run_worker(args)

    def patched_load(path, state, **kwargs):
        plain = load(path, state, **kwargs)
        run["step"] = plain.get("step", run["step"])
        return plain

    def done(batch, steps_per_epoch: int) -> None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if ledger_on and run["ledger"] is None:
            run["ledger"] = _roll_back(run["out"], rank, world, run["step"])
        run["step"] += 1
        step = run["step"]
        if ledger_on:
            ids = batch[2].tolist()
            print(step, (step - 1) // steps_per_epoch, *ids, file=run["ledger"], flush=True)
        if step == kill_at and rank == world - 1:
            marker = run["out"] / f"killed-at-step-{step}"
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if step == pause_at and rank == 0:
            (run["out"] / f"paused-at-step-{step}").touch()
            time.sleep(120)  # the test interrupts the run meanwhile

    class DataLoader(loader_cls):
        def __iter__(self):
            batches = super().__iter__()
            if not getattr(self.sampler, "shuffle", False):  # the evaluation's loader
                return batches
            return self._recorded(batches)

        def _recorded(self, batches):
            pending = None
            for batch in batches:
                if pending is not None:
                    done(pending, len(self))
                pending = batch
                yield batch
            if pending is not None:
                done(pending, len(self))

    job.run_worker, job.load, job.DataLoader = patched_run_worker, patched_load, DataLoader


if os.environ.get("FANFOLD_TEST_LEDGER") == "1" or os.environ.get("FANFOLD_TEST_KILL_AT_STEP") \
        or os.environ.get("FANFOLD_TEST_PAUSE_AT_STEP"):
    sys.meta_path.insert(0, _Finder())
