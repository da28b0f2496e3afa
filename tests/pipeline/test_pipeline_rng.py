"""Dropout in a pipeline: a checkpoint's recomputation draws its own forward's masks, in every stage and micro-batch.

The oracle is plain torch (``_pipeline_rng_models.oracle_grads``): the sequential model on the same micro-batches,
each dropout applying the mask the pipeline's forward drew. With the masks the same, the gradients of every
checkpoint mode are then compared with each other bit for bit, run against run (stages on threads, whatever their
timing), and one stage per process against stages on threads. The dropout-only stages check the masks directly: the
gradient of each output element's own weight is zero exactly where that element was dropped.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import _pipeline_rng_models as models
import fanfold

SEED = 1234
MODES = ("never", "except_last", "always")
CONFIGS = [(stages, chunks, schedule) for stages in (2, 3) for chunks in (1, 2, 3, 4) for schedule in ("gpipe", "1f1b")]


def tight(a: dict, b: dict) -> None:
    # float64, the same products summed in another order at most
    assert_close(a, b, rtol=1e-12, atol=1e-14)


def bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], list):
            assert len(a[key]) == len(b[key]) and all(torch.equal(u, v) for u, v in zip(a[key], b[key])), key
        else:
            assert torch.equal(a[key], b[key]), key


def train_step(kind: str, stages: int, chunks: int, schedule: str, checkpoint: str) -> tuple[dict, dict]:
    """(gradients, forward masks) of one ``Pipeline.train_step`` from ``torch.manual_seed(SEED)``, stages on threads."""
    model = models.MODELS[kind]()
    pipe = fanfold.Pipeline(model, models.BALANCE[stages], ["cpu"] * stages, chunks=chunks, checkpoint=checkpoint)
    x, y = models.batch()
    torch.manual_seed(SEED)
    pipe.train_step(x, y, models.mse, schedule=schedule)
    pipe.close()
    return models.grads(pipe), models.masks(model)


def check_against_oracle(kind: str, chunks: int, got: tuple[dict, dict]) -> None:
    grads, masks = got
    x, y = models.batch()
    assert all(len(m) == len(x.chunk(chunks)) for m in masks.values())  # one forward mask per micro-batch
    tight(grads, models.oracle_grads(models.MODELS[kind], x, y, chunks, masks))


@pytest.mark.parametrize("stages,chunks,schedule", CONFIGS)
def test_every_checkpoint_mode_draws_the_same_masks_and_gets_the_oracle_gradients(stages, chunks, schedule):
    """Known dropout layers (and a custom one beside them): the same masks and gradients in every checkpoint mode
    and every run from the same seed, equal to plain torch's with those masks."""
    runs = {(mode, repeat): train_step("mixed", stages, chunks, schedule, mode) for mode in MODES for repeat in (0, 1)}
    for (mode, repeat), got in runs.items():
        check_against_oracle("mixed", chunks, got)
        bitwise(got[1], runs["never", 0][1])
        bitwise(got[0], runs["never", 0][0])
    masks = runs["never", 0][1]["1"]
    assert len({bytes(m.numpy()) for m in masks}) == len(masks)  # the micro-batches drew masks of their own


@pytest.mark.parametrize("stages,chunks,schedule", CONFIGS)
def test_checkpoint_replays_the_draws_of_layers_it_cannot_see(stages, chunks, schedule):
    """Dropout by ``torch.rand`` in a custom layer only: nothing tells the pipeline a stage draws random numbers,
    and the recomputations still draw the forwards' masks. Without checkpointing the gradients are right too (no
    recomputation), but such draws follow the threads' timing."""
    runs = {(mode, repeat): train_step("custom", stages, chunks, schedule, mode)
            for mode in ("except_last", "always") for repeat in (0, 1)}
    for got in runs.values():
        check_against_oracle("custom", chunks, got)
        bitwise(got[1], runs["always", 0][1])
        bitwise(got[0], runs["always", 0][0])
    check_against_oracle("custom", chunks, train_step("custom", stages, chunks, schedule, "never"))


@pytest.mark.parametrize("kind", ["mixed", "custom"])
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_later_passes_leave_a_stage_that_draws_nothing_alone(kind, checkpoint, schedule):
    """Stage 1 of [2, 2, 5] holds no random layer: after the first pass, which seeds and locks every stage and
    sees that one draw nothing, it runs without a state or a lock; the others' recomputations still replay their
    forwards, pass after pass."""
    model = models.MODELS[kind]()
    pipe = fanfold.Pipeline(model, [2, 2, 5], ["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    x, y = models.batch()
    for step in range(3):
        for layer in models.drops(model).values():
            layer.masks.clear()
        pipe.zero_grad(set_to_none=True)
        torch.manual_seed(SEED + step)
        pipe.train_step(x, y, models.mse, schedule=schedule)
        check_against_oracle(kind, 4, (models.grads(pipe), models.masks(model)))
        assert [key[0] for key in pipe._quiet] == [1]  # white box: the stage left alone is stage 1, and only it
    pipe.close()


def check_mask_consistency(weight_grad: torch.Tensor, output: torch.Tensor) -> None:
    assert torch.equal(weight_grad == 0, output == 0)
    assert 0 < int((output == 0).sum()) < output.numel()  # some elements dropped, some kept


@pytest.mark.parametrize("kind", ["mixed", "custom"])
@pytest.mark.parametrize("stages", [2, 3])
def test_gradient_through_dropout_only_stages_is_zero_exactly_where_the_output_is(stages, kind):
    """Row parameters, then dropout alone on every stage: ``train_step`` in every mode, schedule and chunk count,
    and the forward with a plain backward."""
    balance = [2] + [1] * (stages - 1)
    index, target = models.row_batch()
    for chunks in (1, 2, 3, 4):
        for mode in MODES:
            for schedule in ("gpipe", "1f1b"):
                pipe = fanfold.Pipeline(models.dropout_only(stages, kind), balance, ["cpu"] * stages, chunks, mode)
                loss = models.RecordingDot()
                pipe.train_step(index, target, loss, schedule=schedule)
                check_mask_consistency(pipe.get_parameter("0.weight").grad, torch.cat(loss.outputs))
                pipe.close()
            pipe = fanfold.Pipeline(models.dropout_only(stages, kind), balance, ["cpu"] * stages, chunks, mode)
            output = pipe(index)
            (output * target).sum().backward()
            check_mask_consistency(pipe.get_parameter("0.weight").grad, output.detach())
            pipe.close()


@pytest.mark.timeout(300)
def test_one_stage_per_process_draws_the_masks_of_stages_on_threads():
    """2 ranks, one stage each: every checkpoint mode, schedule and chunk count, twice; gradients equal the oracle's
    and each other, and the masks and gradients are those of a one-process Pipeline from the same seed."""
    configs = [(kind, chunks, schedule, mode) for kind in ("mixed", "custom", "rows:mixed", "rows:custom")
               for chunks in (1, 2, 3, 4) for schedule in ("gpipe", "1f1b") for mode in MODES]
    results = fanfold.launch(models.stage_per_process, configs, SEED, nprocs=2, timeout=240, threads=1)
    index, target = models.row_batch()
    for kind, chunks, schedule, mode in configs:
        merged = []
        for repeat in (0, 1):
            grads, masks = {}, {}
            for rank in (0, 1):
                res = results[rank][kind, chunks, schedule, mode, repeat]
                grads.update(res["grads"])
                masks.update(res["masks"])
            merged.append((grads, masks))
            if kind.startswith("rows:"):
                check_mask_consistency(grads["0.weight"], results[1][kind, chunks, schedule, mode, repeat]["output"])
            else:
                check_against_oracle(kind, chunks, (grads, masks))
        bitwise(merged[0][0], merged[1][0])
        bitwise(merged[0][1], merged[1][1])
        if kind.endswith("custom") and mode == "never":
            continue  # a stage's draws nothing can see are left alone without checkpointing
        if kind.startswith("rows:"):
            pipe = fanfold.Pipeline(models.dropout_only(2, kind.split(":")[1]), [2, 1], ["cpu", "cpu"], chunks, mode)
            model, x, y, loss_fn = pipe, index, target, models.RecordingDot()
        else:
            model = models.MODELS[kind]()
            pipe = fanfold.Pipeline(model, models.BALANCE[2], ["cpu", "cpu"], chunks, mode)
            (x, y), loss_fn = models.batch(), models.mse
        torch.manual_seed(SEED)
        pipe.train_step(x, y, loss_fn, schedule=schedule)
        pipe.close()
        bitwise(merged[0][0], models.grads(pipe))
        bitwise(merged[0][1], models.masks(model))
