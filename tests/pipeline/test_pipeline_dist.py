"""Pipelines over processes equal one process: one stage per process, and data parallelism over pipelines.

Few and small (each a single ``fanfold.launch``, one intra-op thread per rank); the oracle is the plain sequential
model trained in this process on the whole batch (``_pipeline_models``).
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import _pipeline_models as models
import fanfold

STEPS = 3


def run(fn, *args, nprocs: int) -> list:
    return fanfold.launch(fn, *args, nprocs=nprocs, timeout=240, threads=1)


def train_sequential(kind: str, steps: int, rows: int = 12):
    """The oracle: losses, first-step gradients and final weights of the plain model on the whole batches."""
    torch.set_num_threads(1)
    model = models.MODELS[kind]()
    losses, first = [], None
    for step in range(steps):
        x, y = models.batch(kind, rows=rows, seed=step)
        _, loss, grads = models.sequential_step(model, x, y)
        first = grads if first is None else first
        losses.append(loss.item())
        models.sgd(model)
    return losses, first, model


@pytest.mark.timeout(300)
def test_one_stage_per_process_equals_one_process():
    """2 ranks, the transformer stack (tuples with a bool mask cross the process boundary), both schedules, with
    checkpointing; then the no-grad forward for evaluation."""
    results = run(models.stage_per_process, "transformer", [2, 3], 3, "except_last", STEPS, nprocs=2)
    losses, first, model = train_sequential("transformer", STEPS, rows=12)
    state = model.state_dict()
    with torch.no_grad():
        evaluated = model(models.batch("transformer", seed=99)[0])
    for schedule in ("gpipe", "1f1b"):
        got = {}
        for rank, res in enumerate(results):
            assert res[schedule, "losses"] == pytest.approx(losses, rel=1e-9)  # every rank reports the loss
            got.update(res[schedule, "grads"])
            for key, value in res[schedule, "state"].items():
                assert_close(value, state[key])
        assert got.keys() == first.keys()  # the two stages hold all parameters between them
        assert_close(got, first)
        assert results[0][schedule, "eval"] is None
        assert_close(results[1][schedule, "eval"], evaluated)


@pytest.mark.timeout(300)
def test_data_parallel_over_in_process_pipelines_equals_one_process_on_the_whole_batch():
    """2 ranks, each a 2-stage Pipeline on its half of every batch: gradients averaged by train_step's
    data_parallel_group, and (a second model) by fanfold.DistributedDataParallel around a plain backward."""
    results = run(models.pipelines_in_ddp, "mlp", STEPS, nprocs=2)
    losses, _, model = train_sequential("mlp", STEPS)
    for res in results:
        for way in ("explicit", "plain"):
            assert_close(res[way], model.state_dict())
    halves = [sum(pair) / 2 for pair in zip(results[0]["losses"]["explicit"], results[1]["losses"]["explicit"])]
    assert halves == pytest.approx(losses, rel=1e-9)  # the mean of the halves' losses is the whole batch's


@pytest.mark.timeout(300)
def test_pipelines_of_one_stage_per_process_in_data_parallel_equal_one_process():
    """4 ranks: 2 pipelines x 2 stages, 1F1B, each pipeline on half of every batch; pipeline 1 starts from other
    weights, which the construction replaces by pipeline 0's."""
    results = run(models.pipelines_over_processes, "mlp", STEPS, nprocs=4)
    losses, _, model = train_sequential("mlp", STEPS)
    state = model.state_dict()
    assert [(r["stage"], r["dp"]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for res in results:
        assert res["state"].keys() and all(k in state for k in res["state"])
        assert_close(res["state"], {k: state[k] for k in res["state"]})
    halves = [sum(pair) / 2 for pair in zip(results[0]["losses"], results[2]["losses"])]
    assert halves == pytest.approx(losses, rel=1e-9)


def test_skip_connections_between_processes_equal_one_process():
    # 3 stages: "a" is stashed on stage 0 and popped on stage 2, over stage 1
    results = run(models.skips_per_process, [2, 4, 5], 3, "always", nprocs=3)
    x, y = models.batch("mlp", rows=13)
    _, ref_loss, ref_grads = models.sequential_step(models.skip_model(), x, y)
    for schedule in ("gpipe", "1f1b"):
        merged = {}
        for loss, grads in (r[schedule] for r in results):
            assert_close(torch.tensor(loss, dtype=torch.float64), ref_loss)
            merged.update(grads)
        assert_close(merged, ref_grads)
