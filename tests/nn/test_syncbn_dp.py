"""SyncBatchNorm inside fanfold DataParallel (2 and 3 CPU replicas, threads, no torch.distributed), against plain
BatchNorm applied to the whole batch: output and gradients of the first step, parameters and running statistics
after 10 SGD steps; even, uneven (5 + 3) and empty chunks; backward run by the replicas' threads
(parallel_backward=True) and by autograd's engine one replica after another (False); numerics far from zero mean;
the errors (replicas not linked, a replica that never arrives, one value per channel); several GPUs (gpu)."""
import copy

import pytest
import torch
from torch import nn

import fanfold
from _syncbn_models import STEPS, assert_matches, cnn, oracle, step_batch, train
from fanfold import DataParallel, SyncBatchNorm

CASES = [(2, None), (2, [5, 3]), (3, None), (3, [5, 0, 3])]  # replicas, chunk sizes (None: torch's even split)


def _train_dp(replicas: int, chunks, parallel_backward: bool, devices=None) -> dict:
    total = sum(chunks) if chunks else 8
    model = SyncBatchNorm.convert_sync_batchnorm(cnn())
    devices = devices or ["cpu"] * replicas
    model = model.to(devices[0])
    dp = DataParallel(model, device_ids=devices, chunk_sizes=chunks, parallel_backward=parallel_backward)
    batches = ((x.to(devices[0]), y, total, 1) for x, y in (step_batch(step, total) for step in range(STEPS)))
    return train(model, dp, batches)


@pytest.mark.parametrize("parallel_backward", [True, False])
@pytest.mark.parametrize("replicas,chunks", CASES)
def test_replicas_match_batchnorm_on_the_whole_batch(replicas, chunks, parallel_backward):
    total = sum(chunks) if chunks else 8
    assert_matches(_train_dp(replicas, chunks, parallel_backward), oracle([[total]] * STEPS), [total], 0)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("parallel_backward", [True, False])
def test_statistics_stay_exact_far_from_zero_mean(parallel_backward, channels_last):
    # float32 data with |mean|/std = 1000: a sum of squares would cancel to nothing; the per-part moments keep
    # SyncBatchNorm as close to float64 as plain float32 BatchNorm is on contiguous data (channels-last data takes
    # the corrected two-pass path)
    x = torch.randn(10, 3, 4, 4, generator=torch.Generator().manual_seed(0)) + 1000.0
    exact = nn.BatchNorm2d(3).double()
    want = exact(x.double())
    plain = nn.BatchNorm2d(3)
    plain_err = (plain(x).double() - want).abs().max().item()
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    sync = SyncBatchNorm(3)
    out = DataParallel(sync, device_ids=["cpu"] * 3, chunk_sizes=[5, 3, 2], parallel_backward=parallel_backward)(x)
    assert (out.double() - want).abs().max().item() <= 4 * plain_err + 1e-6
    torch.testing.assert_close(sync.running_var.double(), exact.running_var, rtol=1e-5, atol=0)
    torch.testing.assert_close(sync.running_mean.double(), exact.running_mean, rtol=1e-6, atol=0)


def test_eval_uses_the_running_statistics():
    model = SyncBatchNorm.convert_sync_batchnorm(cnn())
    ref = copy.deepcopy(model)
    x, _ = step_batch(0, 8)
    DataParallel(model, device_ids=["cpu", "cpu"])(x)  # one training step updates the running statistics
    model.eval()
    ref.load_state_dict(model.state_dict())
    ref = fanfold.revert_sync_batchnorm(ref).eval()
    torch.testing.assert_close(DataParallel(model, device_ids=["cpu", "cpu"])(x), ref(x), rtol=1e-6, atol=1e-6)


def test_replicas_not_linked_by_fanfold_dataparallel_are_refused():
    model = SyncBatchNorm(4)
    replicas = fanfold.replicate(model, ["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="does not link SyncBatchNorm's replicas.*use fanfold.DataParallel"):
        replicas[0](torch.randn(4, 4))


class _FailsOnReplica1(nn.Module):
    """Raises before its BatchNorm on the chunk that holds a sample marked with a NaN (replica 1's)."""

    def __init__(self):
        super().__init__()
        self.bn = SyncBatchNorm(2)

    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("bad sample")
        return self.bn(x)


def test_a_replica_that_never_arrives_fails_the_others_in_bounded_time(monkeypatch):
    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", "1")
    x = torch.randn(6, 2)
    x[4, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"replica\(s\) \[1\] of 2 did not reach the forward within 1 s"):
        DataParallel(_FailsOnReplica1(), device_ids=["cpu", "cpu"])(x)


def test_one_value_per_channel_over_the_whole_batch_is_an_error():
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training, got 1 over the "
                                         "whole batch"):
        DataParallel(SyncBatchNorm(3), device_ids=["cpu", "cpu"], chunk_sizes=[1, 0])(torch.randn(1, 3))


@pytest.mark.parametrize("parallel_backward", [True, False])
def test_an_empty_whole_batch_is_plain_batchnorms_no_op(parallel_backward):
    plain, sync = nn.BatchNorm1d(3), SyncBatchNorm(3)
    for bn in (plain, sync):
        bn.running_mean.fill_(5.0)
    x = torch.zeros(0, 3, 4, requires_grad=True)
    out = DataParallel(sync, device_ids=["cpu", "cpu"], chunk_sizes=[0, 0], parallel_backward=parallel_backward)(x)
    out.sum().backward()
    want = plain(x)
    assert out.shape == want.shape == (0, 3, 4) and x.grad.shape == (0, 3, 4)
    for a, b in zip(sync.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)  # running statistics kept, num_batches_tracked counted


def test_channel_mismatch_names_both_counts():
    with pytest.raises(ValueError, match=r"num_features=4\): the input has 3 channels"):
        DataParallel(SyncBatchNorm(4), device_ids=["cpu", "cpu"])(torch.randn(4, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("parallel_backward", [True, False])
def test_gpu_replicas_match_batchnorm_on_the_whole_batch(parallel_backward, monkeypatch):
    # two replicas on each GPU there is (the same GPU twice on a one-GPU machine): autograd's engine runs backward;
    # TF32 off, so that the GPU's float32 is the CPU oracle's
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    got = _train_dp(2, [5, 3], parallel_backward, devices=devices)
    total = 8
    want = oracle([[total]] * STEPS)
    assert_matches(got, want, [total], 0)


def test_process_engine_refused():
    """engine='process' runs each replica in its own process, where SyncBatchNorm's replicas cannot meet: refused,
    naming the layer, rather than normalising each chunk alone."""
    model = SyncBatchNorm.convert_sync_batchnorm(cnn())
    with pytest.raises(ValueError, match="engine='process'.*SyncBatchNorm"):
        DataParallel(model, device_ids=["cpu", "cpu"], engine="process")
