"""What a torchgpipe user expects of fanfold.Pipeline: deferred BatchNorm, a sequential model's container behaviour,
early stop on an error, no recomputation outside training, checkpoint modes by torchgpipe's names.

The oracle is the plain sequential model on the whole batch, single process, in float64.
"""
from __future__ import annotations

import copy
import threading
import time
import traceback

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fanfold
from _pipeline_models import batch, grads, mlp, mse, sequential_step, skip_model
from fanfold.pipeline import Pop, Stash


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- deferred BatchNorm ------------------------------------------------------------------------------------------
def bn_model(kind: str, momentum: float | None) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(0)
    if kind == "1d":
        layers = [nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Tanh(), nn.Linear(8, 3),
                  nn.BatchNorm1d(3, momentum=momentum)]
    elif kind == "2d":
        layers = [nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Conv2d(4, 3, 1),
                  nn.BatchNorm2d(3, momentum=momentum)]
    else:
        layers = [nn.Conv3d(2, 4, 1), nn.BatchNorm3d(4, momentum=momentum), nn.Tanh(), nn.Conv3d(4, 2, 1),
                  nn.BatchNorm3d(2, momentum=momentum)]
    model = nn.Sequential(*layers).double()
    for m in model.modules():  # not the initial weights: a wrong affine term must show
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model, [2, 3]


def bn_batch(kind: str, seed: int, rows: int = 20) -> torch.Tensor:
    shape = {"1d": (6,), "2d": (2, 5, 5), "3d": (2, 3, 3, 3)}[kind]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, *shape, generator=g, dtype=torch.float64) * 2 + 1


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in module.named_buffers()}


def deferred_oracle(model: nn.Sequential, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """torchgpipe's deferred BatchNorm written plainly on the whole batch: each BatchNorm layer moves its running
    statistics by torch's own forward on all the rows it receives, and normalises each micro-batch's rows
    (``torch.chunk``'s cut) with their own statistics."""
    h = x
    for layer in model:
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training:
            layer(h)  # the running statistics of the whole batch; its output is not the pipeline's
            h = torch.cat([nn.functional.batch_norm(c, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)
                           for c in h.chunk(chunks)])
        else:
            h = layer(h)
    return h


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("kind", ["1d", "2d", "3d"])
def test_deferred_batchnorm_keeps_the_whole_batchs_running_statistics(kind, momentum):
    # 20 rows: chunks 3, 7 and 8 give an uneven last micro-batch (7, 7, 6; six of 3 and one of 2)
    for chunks in range(1, 9):
        checkpoint = ("never", "except_last", "always")[chunks % 3]
        plain, ref = bn_model(kind, momentum)[0], bn_model(kind, momentum)[0]
        model, balance = bn_model(kind, momentum)
        pipe = fanfold.Pipeline(model, balance, ["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint,
                                deferred_batch_norm=True)
        for step in range(3):
            x = bn_batch(kind, step)
            plain(x)  # the sequential model on the whole batch
            ref_out = deferred_oracle(ref, x, chunks)
            if step == 0:  # connected: a checkpoint's recomputation runs in the caller's backward, after the pass
                out = pipe(x)
                out.pow(2).mean().backward()
                # in training each micro-batch is normalised with its own statistics, as torchgpipe does
                assert_close(out, ref_out)
            else:
                pipe.train_step(x, None, lambda o: o.pow(2).mean(), schedule=("gpipe", "1f1b")[step - 1])
            assert_close(buffers(pipe), buffers(ref), msg=lambda m: f"chunks={chunks} step={step}: {m}")
            # the first BatchNorm sees what it sees in the sequential model: its statistics are the whole batch's
            first = {n: b for n, b in buffers(plain).items() if n.startswith("1.")}
            assert_close({n: b for n, b in buffers(pipe).items() if n.startswith("1.")}, first)
        pipe.eval()
        ref.eval()
        x = bn_batch(kind, 7)
        assert_close(pipe(x), ref(x))  # eval mode: the running statistics
        with torch.no_grad():
            pipe(x)
        assert_close(buffers(pipe), buffers(ref))  # eval passes move nothing
        pipe.close()


def test_without_deferral_batchnorm_still_moves_per_microbatch():
    model, balance = bn_model("1d", 0.1)
    ref = copy.deepcopy(model)
    pipe = fanfold.Pipeline(model, balance, ["cpu", "cpu"], chunks=4)
    x = bn_batch("1d", 0)
    pipe(x)
    for c in x.chunk(4):
        ref(c)
    assert_close(buffers(pipe), buffers(ref))


@pytest.mark.parametrize("sync", [nn.SyncBatchNorm, fanfold.SyncBatchNorm])
def test_sync_batchnorm_in_a_pipeline_is_refused(sync):
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), sync(4)))
    with pytest.raises(TypeError, match=r"1\.1 is a SyncBatchNorm.*deferred_batch_norm=True"):
        fanfold.Pipeline(model, [1, 1], ["cpu", "cpu"], deferred_batch_norm=True)
    with pytest.raises(TypeError, match=r"SyncBatchNorm"):
        fanfold.Pipeline(model, [1, 1], ["cpu", "cpu"])


# ---- a sequential model's container ------------------------------------------------------------------------------
def test_len_indexing_iteration_and_names_are_the_sequential_models():
    model = mlp()
    pipe = fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], chunks=3)
    assert len(pipe) == len(model) == 7
    assert [type(m) for m in pipe] == [type(m) for m in model]
    assert [n for n, _ in pipe.named_children()] == [n for n, _ in model.named_children()]
    assert list(pipe.state_dict()) == list(model.state_dict())
    layers = list(pipe)
    assert pipe[0] is layers[0] and pipe[-1] is layers[-1] and pipe[3] is layers[3]
    part = pipe[2:5]
    assert isinstance(part, nn.Sequential) and list(part) == layers[2:5]
    with pytest.raises(IndexError):
        pipe[7]
    x, y = batch("mlp", rows=10)
    for again in (fanfold.Pipeline(pipe, [2, 5], ["cpu", "cpu"], chunks=2),
                  fanfold.Pipeline(list(pipe), [4, 3], ["cpu", "cpu"], chunks=4),
                  fanfold.Pipeline(nn.Sequential(*pipe), [7], ["cpu"])):
        assert list(again.state_dict()) == list(model.state_dict())
        assert_close(again(x), pipe(x))
        ref_out, ref_loss, ref_grads = sequential_step(mlp(), x, y)
        again.zero_grad(set_to_none=True)
        assert_close(again.train_step(x, y, mse), ref_loss)
        assert_close(grads(again), ref_grads)


# ---- early stop --------------------------------------------------------------------------------------------------
class Counted(nn.Module):
    """Stage 0's layer: counts its calls; from the second on, waits until the failure happened downstream."""

    def __init__(self, failed: threading.Event):
        super().__init__()
        self.calls, self.failed, self.waiting = 0, failed, True

    def forward(self, x):
        self.calls += 1
        if self.waiting and self.calls > 1 and self.failed.wait(timeout=20):
            time.sleep(0.2)  # the failing worker marks the pass as failed right after raising
        return x


class FailsFirst(nn.Module):
    def __init__(self, failed: threading.Event):
        super().__init__()
        self.failed, self.armed = failed, True

    def forward(self, x):
        if self.armed:
            self.failed.set()
            raise_boom()
        return x


def raise_boom():
    raise ValueError("boom in the failing layer")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["forward", "gpipe", "1f1b"])
def test_an_error_stops_later_microbatches_and_keeps_its_traceback(mode):
    failed = threading.Event()
    counted, failing = Counted(failed), FailsFirst(failed)
    layers = [nn.Linear(8, 8).double(), counted, failing, nn.Linear(8, 4).double()]
    pipe = fanfold.Pipeline(layers, [2, 2], ["cpu", "cpu"], chunks=8)
    x, y = batch("mlp", rows=16)
    with pytest.raises(ValueError, match=r"in pipeline stage 1 on cpu: ValueError: boom") as info:
        pipe(x) if mode == "forward" else pipe.train_step(x, y, mse, schedule=mode)
    # stage 0 stopped scheduling micro-batches: at most the one in flight when stage 1 failed, and the next
    assert counted.calls <= 3, f"stage 0 ran {counted.calls} of 8 micro-batches after stage 1 failed"
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_boom" in frames and "forward" in frames  # the original traceback, down to the failing line
    failing.armed, counted.waiting = False, False  # the workers are ready for the next call
    ref = nn.Sequential(*layers)
    assert_close(pipe(x), ref(x))
    ref_out, ref_loss, ref_grads = sequential_step(ref, x, y)
    pipe.zero_grad(set_to_none=True)
    assert_close(pipe.train_step(x, y, mse), ref_loss)
    assert_close(grads(pipe), ref_grads)


# ---- checkpointing only where it can pay ------------------------------------------------------------------------
class Calls(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(8, 8).double(), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_no_recomputation_in_eval_mode_or_without_grad(checkpoint):
    calls = Calls()
    pipe = fanfold.Pipeline([nn.Linear(8, 8).double(), calls], [1, 1], ["cpu", "cpu"], chunks=4,
                            checkpoint=checkpoint)
    x, y = batch("mlp", rows=8)
    recomputed = 4 if checkpoint == "always" else 3
    pipe(x).sum().backward()
    assert calls.calls == 4 + recomputed  # training: the checkpointed micro-batches are recomputed
    pipe.eval()
    for run in (lambda: pipe(x).sum().backward(), lambda: pipe.train_step(x, None, lambda o: o.mean())):
        calls.calls = 0
        run()
        assert calls.calls == 4, "eval mode recomputed a forward"
    pipe.train()
    calls.calls = 0
    with torch.no_grad():
        pipe(x)
    assert calls.calls == 4


@pytest.mark.parametrize("bad", ["sometimes", "except-last", True, None, ["always"]])
def test_checkpoint_modes_are_torchgpipes_names(bad):
    with pytest.raises(ValueError, match=r"checkpoint must be one of \['never', 'except_last', 'always'\], got"):
        fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], checkpoint=bad)


def test_deferred_batch_norm_is_a_bool():
    with pytest.raises(TypeError, match=r"deferred_batch_norm must be True or False, got 'yes'"):
        fanfold.Pipeline(mlp(), [3, 4], ["cpu", "cpu"], deferred_batch_norm="yes")


# ---- skip connections ----------------------------------------------------------------------------------------------
SKIP_BALANCES = [[8, 3], [2, 4, 5], [1, 4, 2, 4]]  # b popped on its own stage; over one stage; a over two


@pytest.mark.parametrize("balance", SKIP_BALANCES, ids=["local-and-next", "3stages", "across-stages"])
def test_skip_connections_equal_the_unsplit_model(balance):
    x, y = batch("mlp", rows=13)
    ref_out, ref_loss, ref_grads = sequential_step(skip_model(), x, y)
    for chunks in range(1, 9):
        checkpoint = ("never", "except_last", "always")[chunks % 3]
        pipe = fanfold.Pipeline(skip_model(), balance, ["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
        out = pipe(x)
        assert_close(out, ref_out)
        mse(out, y).backward()
        assert_close(grads(pipe), ref_grads)
        for schedule in ("gpipe", "1f1b"):
            pipe.zero_grad(set_to_none=True)
            assert_close(pipe.train_step(x, y, mse, schedule=schedule), ref_loss)
            assert_close(grads(pipe), ref_grads, msg=lambda m: f"chunks={chunks} {schedule}: {m}")
        pipe.close()


def test_skip_declarations_are_checked():
    a = Stash("a")
    with pytest.raises(ValueError, match=r"1 stashes 'a' but no later layer pops it"):
        fanfold.Pipeline([nn.Linear(2, 2), a, nn.Linear(2, 2)], [2, 1], ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"0 pops 'a' but no layer before it stashes 'a'"):
        fanfold.Pipeline([Pop(a), a, nn.Linear(4, 2)], [1, 2], ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"2 stashes 'a', which 0 stashes already"):
        fanfold.Pipeline([a, Pop(a), Stash("a"), Pop(a)], [2, 2], ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"Pop takes the Stash"):
        Pop("a")
    plain = nn.Sequential(nn.Linear(2, 2), Pop(a))  # the plain model: a Pop with nothing stashed
    with pytest.raises(RuntimeError, match=r"Pop\('a'\) ran but nothing is stashed under 'a'"):
        plain(torch.randn(3, 2))
    twice = nn.Sequential(a, nn.Linear(2, 2))  # never popped: the next forward stashes again
    twice(torch.randn(3, 2))
    with pytest.raises(RuntimeError, match=r"Stash\('a'\) ran again before its Pop took"):
        twice(torch.randn(3, 2))


def test_stash_and_pop_inside_blocks():
    def model():
        torch.manual_seed(0)
        a = Stash("a")
        return nn.Sequential(nn.Sequential(nn.Linear(8, 8), a), nn.Tanh(),
                             nn.Sequential(Pop(a), nn.Linear(16, 4))).double()

    x, y = batch("mlp", rows=9)
    ref_out, ref_loss, ref_grads = sequential_step(model(), x, y)
    pipe = fanfold.Pipeline(model(), [1, 1, 1], ["cpu"] * 3, chunks=3, checkpoint="except_last")
    assert_close(pipe(x), ref_out)
    assert_close(pipe.train_step(x, y, mse), ref_loss)
    assert_close(grads(pipe), ref_grads)
    with pytest.raises(ValueError, match=r'balance="profile" .* skip connection \(0\.1\)'):
        fanfold.Pipeline(model(), "profile", ["cpu"] * 3, sample_input=x)
