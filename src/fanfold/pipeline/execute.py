"""Drive the stages through their steps: serially in the caller's thread, or each stage on its own worker thread.

Each worker follows only its own stage's order (checked by ``schedule.stage_orders``, so it cannot deadlock) and
blocks on the channel for its inputs. An error in a stage aborts the channel and is raised in the caller, once every
worker has returned, as the same exception type naming the stage and its device.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..parallel.parallel_apply import WorkerPool
from .channel import Channel, StageAborted
from .schedule import Step, clocked
from .stage import StageRun
from .threadstate import ThreadState

__all__ = ["run_serial", "run_threads", "reraise"]


def reraise(stage: int, run: StageRun, exc: BaseException) -> None:
    """Raise ``exc`` again, its message naming the stage and device; KeyboardInterrupt and the like as they are."""
    if not isinstance(exc, Exception):
        raise exc
    message = f"in pipeline stage {stage} on {run.spec.device}: {type(exc).__name__}: {exc}"
    try:
        err = type(exc)(message)
    except Exception:
        err = RuntimeError(message)
    raise err from exc


def run_serial(runs: Sequence[StageRun], orders: list[list[Step]], state: ThreadState) -> None:
    """Every step in clock order on the calling thread (one stage, one micro-batch, or no worker threads)."""
    for cycle in clocked(orders):
        for step in cycle:
            run = runs[step.stage]
            try:
                with state.applied(run.spec.device):
                    run.run(step)
            except BaseException as exc:
                reraise(step.stage, run, exc)


def _work(run: StageRun, order: list[Step], channel: Channel, state: ThreadState) -> None:
    try:
        with state.applied(run.spec.device):
            for step in order:
                run.run(step)
    except BaseException:
        channel.abort(run.spec.index)
        raise


def run_threads(runs: Sequence[StageRun], orders: list[list[Step]], channel: Channel, state: ThreadState,
                pool: WorkerPool) -> None:
    """Stage s's steps on worker s of ``pool``, all stages at once; returns when every stage is done."""
    results = pool.run([
        # default arguments bind this stage's values (a closure would see the loop's last ones)
        lambda run=run, order=order: _work(run, order, channel, state)
        for run, order in zip(runs, orders)
    ])
    failed = [(s, value) for s, (ok, value) in enumerate(results) if not ok]
    if failed:
        # the stage that failed first is the one whose error is not "stopped because another stage failed"
        s, exc = next(((s, e) for s, e in failed if not isinstance(e, StageAborted)), failed[0])
        reraise(s, runs[s], exc)
