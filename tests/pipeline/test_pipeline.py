"""fanfold.Pipeline in one process equals the sequential model: outputs, losses, gradients, BatchNorm statistics.

The oracle is the same model run plainly on the whole batch (``_pipeline_models.sequential_step``). Models are in
float64 so that the only differences left are summation order (micro-batch gradients are added up).
"""
from __future__ import annotations

import collections
import copy
import threading
import time
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import set_checkpoint_early_stop

import fanfold
from _pipeline_models import MODELS, batch, grads, mlp, mse, sequential_step
from fanfold.pipeline import Step, balance_by_parameters


@pytest.fixture(autouse=True)
def one_thread():
    """The oracle on one intra-op thread: tiny float64 ops on an OpenMP team of a shared, busy machine take tens of
    milliseconds each (the workers run one thread each anyway)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CASES = [("mlp", [3, 4]), ("mlp", [2, 2, 3]), ("transformer", [2, 3]), ("transformer", [1, 2, 2])]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", range(1, 9))
@pytest.mark.parametrize("kind,balance", CASES, ids=[f"{k}-{len(b)}stages" for k, b in CASES])
def test_equals_sequential(kind, balance, chunks, checkpoint):
    # 13 rows: uneven micro-batches (chunks=8 gives seven of 2 and one of 1), so the loss weights matter;
    # mlp [3, 4] starts stage 1 with ReLU(inplace=True), which must work on what the stage receives
    x, y = batch(kind, rows=13)
    ref_out, ref_loss, ref_grads = sequential_step(MODELS[kind](), x, y)
    pipe = fanfold.Pipeline(MODELS[kind](), balance, ["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
    out = pipe(x)
    assert_close(out, ref_out)
    mse(out, y).backward()  # one autograd graph over the stages: a plain backward
    plain = grads(pipe)
    assert plain.keys() == ref_grads.keys()
    assert_close(plain, ref_grads)
    for schedule in ("gpipe", "1f1b"):
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, mse, schedule=schedule)
        assert_close(loss, ref_loss)
        assert_close(grads(pipe), plain)  # the explicit schedule equals the plain backward
    micro = len(torch.arange(13).chunk(chunks))
    assert sorted((t.stage, t.microbatch, t.phase) for t in pipe.last_timeline) == sorted(
        (s, m, p) for s in range(len(balance)) for m in range(micro) for p in "FB")


def test_state_dict_has_the_sequential_keys():
    model = mlp()
    pipe = fanfold.Pipeline(mlp(seed=3), [3, 4], ["cpu", "cpu"])
    assert list(pipe.state_dict()) == list(model.state_dict())
    pipe.load_state_dict(model.state_dict())
    x, _ = batch("mlp")
    assert_close(pipe(x), model(x))
    assert isinstance(pipe.module, nn.Sequential) and len(pipe.module) == 7
    assert [len(s) for s in pipe.stages] == [3, 4]


def test_a_list_of_modules_is_a_sequential_model():
    layers = list(mlp())
    pipe = fanfold.Pipeline(layers, [4, 3], ["cpu", "cpu"], chunks=2)
    x, _ = batch("mlp")
    assert_close(pipe(x), nn.Sequential(*layers)(x))


def test_fewer_microbatches_than_chunks_for_a_small_batch():
    model = mlp()
    pipe = fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], chunks=8)
    x, y = batch("mlp", rows=3)
    assert [t.shape[0] for t in pipe.split(x)] == [1, 1, 1]
    assert_close(pipe(x), model(x))
    assert_close(pipe.train_step(x, y, mse), mse(model(x), y))
    assert {t.microbatch for t in pipe.last_timeline} == {0, 1, 2}
    pipe.chunks = 4  # torch.chunk's rule: 6 rows in chunks of ceil(6 / 4) = 2 give 3 micro-batches
    assert [t.shape[0] for t in pipe.split(batch("mlp", rows=6)[0])] == [2, 2, 2]


def test_sum_reduction():
    x, y = batch("mlp", rows=10)
    model = mlp()
    loss = ((model(x) - y) ** 2).sum()
    loss.backward()
    pipe = fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], chunks=4)
    got = pipe.train_step(x, y, lambda o, t: ((o - t) ** 2).sum(), reduction="sum")
    assert_close(got, loss.detach())
    assert_close(grads(pipe), grads(model))


def test_batchnorm_statistics_are_per_microbatch():
    """Documented semantics: each micro-batch is normalised with its own statistics, and the running statistics
    are updated once per micro-batch, in order; checkpointing's recomputation does not update them again."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()

    x = torch.randn(16, 6, dtype=torch.float64)
    ref = model()
    expected = torch.cat([ref(c) for c in x.chunk(4)])  # the oracle: the plain model, one micro-batch at a time
    assert not torch.allclose(expected, model()(x))  # whole-batch statistics would give another result
    for checkpoint in ("never", "always"):
        pipe = fanfold.Pipeline(model(), [2, 2], ["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
        out = pipe(x)
        assert_close(out, expected)
        out.sum().backward()  # recomputes the checkpointed stages: the running statistics must not move again
        assert_close(pipe.state_dict(), ref.state_dict())
    pipe.eval()
    assert_close(pipe(x), ref.eval()(x))  # eval mode: the running statistics, no per-micro-batch effect


def test_balance_auto_by_parameter_count():
    layers = [nn.Linear(4, 100), nn.ReLU(), nn.Linear(100, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    # parameters: 500, 0, 404, 20, 20, 20 -> the big first layer alone cannot be split; [1, 5] and [2, 4] cost
    # 500 at most, and [2, 4] has fewer layers in its largest stage
    assert balance_by_parameters(layers, 2) == [2, 4]
    assert balance_by_parameters(layers, 3) == [2, 2, 2]  # 500, 424, 60: no stage can cost less than 500
    pipe = fanfold.Pipeline(nn.Sequential(*layers), "auto", ["cpu", "cpu", "cpu"])
    assert pipe.balance == [2, 2, 2]
    assert balance_by_parameters([nn.Linear(3, 3)] * 1 + [nn.ReLU()] * 3, 4) == [1, 1, 1, 1]


class Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.03)
        return x * 1.0


def test_balance_profile_by_time():
    layers = [Sleep(), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    before = [p.detach().clone() for p in nn.Sequential(*layers).parameters()]
    pipe = fanfold.Pipeline(nn.Sequential(*layers), "profile", ["cpu", "cpu"], sample_input=torch.randn(4, 4))
    assert pipe.balance == [1, 3]  # the slow layer alone: by parameter count it would share a stage
    assert balance_by_parameters(layers, 2) != [1, 3]
    assert all(p.grad is None for p in pipe.parameters())  # the timing leaves no gradient behind
    assert_close([p.detach() for p in pipe.parameters()], before)


@pytest.mark.parametrize("make,match", [
    (lambda: fanfold.Pipeline(mlp(), [3, 3], ["cpu", "cpu"]), r"sums to 6 but the model has 7 layers"),
    (lambda: fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu", "cpu"]), r"has 2 stages but devices has 3"),
    (lambda: fanfold.Pipeline(mlp(), [3, 0, 4], ["cpu"] * 3), r"ints >= 1"),
    (lambda: fanfold.Pipeline(mlp(), "auto"), r"needs devices"),
    (lambda: fanfold.Pipeline(mlp(), "auto", ["cpu"] * 8), r"8 stages but the model has only 7 layers"),
    (lambda: fanfold.Pipeline(mlp(), "profile", ["cpu"] * 2), r"sample_input"),
    (lambda: fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], chunks=0), r"chunks must be an int >= 1"),
    (lambda: fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], checkpoint="sometimes"), r"checkpoint must be one of"),
    (lambda: fanfold.Pipeline(mlp(), [3, 4], "cpu"), r"one device per stage"),
    (lambda: fanfold.Pipeline(nn.Sequential(), [1], ["cpu"]), r"no layers"),
], ids=["sum", "lengths", "empty-stage", "auto-without-devices", "too-many-stages", "profile-without-sample",
        "chunks", "checkpoint", "device-not-list", "empty"])
def test_bad_arguments_are_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_non_sequential_modules_are_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    with pytest.raises(TypeError, match=r"sequential model .* got Net"):
        fanfold.Pipeline(Net(), [1, 1], ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"module\[1\] is a str"):
        fanfold.Pipeline([nn.Linear(2, 2), "relu"], [1, 1], ["cpu", "cpu"])


def test_bad_step_arguments_are_clear_errors():
    pipe = fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], chunks=2)
    x, y = batch("mlp", rows=8)
    with pytest.raises(TypeError, match="loss_fn"):
        pipe.train_step(x, y)
    with pytest.raises(ValueError, match="target has 7 rows along dim 0 but input has 8"):
        pipe.train_step(x, y[:7], mse)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipe.train_step(x, y, mse, schedule="zigzag")
    with pytest.raises(ValueError, match="reduction"):
        pipe.train_step(x, y, mse, reduction="none")
    with pytest.raises(ValueError, match="0-dim tensor"):
        fanfold.Pipeline([nn.Linear(8, 2), nn.Flatten(0)], [1, 1], ["cpu", "cpu"])(torch.tensor(1.0))
    scalar = fanfold.Pipeline([nn.Linear(8, 2).double(), Mean()], [1, 1], ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="must keep the batch dimension"):
        scalar(x)
    with pytest.raises(RuntimeError, match="stay on their devices"):
        pipe.to("cpu")
    assert pipe.to(torch.float32) is pipe and next(pipe.parameters()).dtype == torch.float32


class Mean(nn.Module):
    def forward(self, x):
        return x.mean()


class Explode(nn.Module):
    def __init__(self, at_call: int):
        super().__init__()
        self.at_call, self.calls = at_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            raise ValueError("boom")
        return x


@pytest.mark.timeout(60)
def test_an_error_in_a_stage_is_raised_naming_it_and_never_hangs():
    layers = list(mlp()) + [Explode(at_call=2)]
    pipe = fanfold.Pipeline(layers, [4, 4], ["cpu", "cpu"], chunks=4)
    x, y = batch("mlp", rows=8)
    for attempt in (lambda: pipe.train_step(x, y, mse), lambda: pipe(x)):
        layers[-1].calls = 0
        with pytest.raises(ValueError, match=r"in pipeline stage 1 on cpu: ValueError: boom") as info:
            attempt()
        assert isinstance(info.value.__cause__, ValueError)
    layers[-1].at_call = -1
    assert_close(pipe(x), nn.Sequential(*layers)(x))  # the pipeline is still usable


class Probe(nn.Module):
    """Records, per call, the thread's grad mode, autocast state and intra-op thread count."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        self.seen.append((threading.get_ident(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                          torch.get_num_threads()))
        return self.lin(x)


@pytest.mark.parametrize("threads_per_stage", [1, 2])
def test_workers_get_the_callers_grad_mode_and_autocast_and_their_own_thread_count(threads_per_stage):
    probe0, probe1 = Probe(), Probe()
    pipe = fanfold.Pipeline([probe0, probe1], [1, 1], ["cpu", "cpu"], chunks=2, threads_per_stage=threads_per_stage)
    caller = torch.get_num_threads()
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert not pipe(x).requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    pipe.train_step(x, torch.randn(4, 8), lambda o, t: ((o.float() - t) ** 2).mean())
    seen = probe0.seen + probe1.seen
    assert {ident for ident, *_ in seen}.isdisjoint({threading.get_ident()})  # every stage ran on a worker
    assert [(g, a) for _, g, a, _ in probe0.seen] == [(False, False)] * 2 + [(True, True)] * 2 + [(True, False)] * 2
    assert {n for *_, n in seen} == {threads_per_stage}
    assert torch.get_num_threads() == caller  # the caller's own count is left alone
    pipe.close()


def test_custom_schedules_are_checked():
    pipe = fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], chunks=2)
    x, y = batch("mlp", rows=8)
    model = mlp()
    mse(model(x), y).backward()

    def oldest_first(stages, microbatches):  # a valid schedule of its own: one step per cycle, oldest first
        for m in range(microbatches):
            for s in range(stages):
                yield [Step(s, m, "F")]
        for m in range(microbatches):
            for s in reversed(range(stages)):
                yield [Step(s, m, "B")]

    pipe.train_step(x, y, mse, schedule=oldest_first)
    assert_close(grads(pipe), grads(model))

    def deadlock(stages, microbatches):
        yield [Step(s, m, p) for s in range(stages) for p in "BF" for m in range(microbatches)]

    with pytest.raises(ValueError, match="deadlocks"):
        pipe.train_step(x, y, mse, schedule=deadlock)
    with pytest.raises(ValueError, match="never runs"):
        pipe.train_step(x, y, mse, schedule=lambda s, m: [[Step(0, 0, "F")]])


class RecordingDropout(nn.Dropout):
    """Dropout that keeps every mask it draws, forward and recomputation alike."""

    def __init__(self, p: float):
        super().__init__(p)
        self.masks = []

    def forward(self, x):
        out = super().forward(x)
        self.masks.append(out != 0)
        return out


def test_checkpointed_dropout_on_stages_sharing_a_generator_recomputes_the_same_masks():
    """Two CPU stages share torch's CPU generator and run at the same time: each recomputation still draws its own
    forward's masks (each cell's generator state, stage.py), with no warning and no fallback to one thread. More in
    test_pipeline_rng.py."""
    drops = [RecordingDropout(0.5), RecordingDropout(0.5)]
    layers = [nn.Linear(8, 32), drops[0], nn.Linear(32, 32), drops[1], nn.Linear(32, 4)]
    pipe = fanfold.Pipeline(layers, [2, 3], ["cpu", "cpu"], chunks=4, checkpoint="always")
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    # without early stopping, a recomputation runs to the end of the stage, so every dropout records its mask
    with warnings.catch_warnings(), set_checkpoint_early_stop(False):
        warnings.simplefilter("error")
        out = pipe(x)
        out.sum().backward()
        pipe.train_step(x, y, lambda o, t: ((o - t) ** 2).mean(), schedule="gpipe")
    for drop in drops:
        # per pass (forward then backward, gpipe in train_step): 4 forwards, then 4 recomputations, each equal to
        # the forward mask of its micro-batch
        for forward, recomputed in ((drop.masks[0:4], drop.masks[4:8]), (drop.masks[8:12], drop.masks[12:16])):
            assert all(any(torch.equal(r, f) for f in forward) for r in recomputed)
            assert len({bytes(f.numpy()) for f in forward}) == 4  # the micro-batches did draw different masks


class _ToDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        return {"h": torch.tanh(self.lin(x)), "skip": x[:, :5]}


Pair = collections.namedtuple("Pair", "a b")


class _DictToPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, d):
        return Pair(self.lin(d["h"]), d["skip"])


class _FromPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 2)

    def forward(self, p):
        return self.lin(p.a + p.b)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_dicts_and_namedtuples_pass_between_stages_as_in_one_sequential(checkpoint):
    # Before the stages' tree walk, a namedtuple between stages crashed and a dict's tensors were not detached.
    torch.manual_seed(0)
    ref = nn.Sequential(_ToDict(), _DictToPair(), _FromPair())
    pipe = fanfold.Pipeline(copy.deepcopy(ref), [1, 1, 1], ["cpu"] * 3, chunks=2,
                            checkpoint=checkpoint)
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    nn.functional.mse_loss(ref(x), y).backward()
    out = pipe(x)
    nn.functional.mse_loss(out, y).backward()
    assert_close(out, ref(x))
    assert_close([p.grad for p in pipe.parameters()], [p.grad for p in ref.parameters()])
