"""fanfold.SyncBatchNorm alone (one process, nothing to synchronise with) against torch's BatchNorm: the same
results bit for bit for every input dimension and option; eval mode; errors; torch's SyncBatchNorm state dict in
and out; convert_sync_batchnorm and revert_sync_batchnorm; copies and pickles."""
import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fanfold
from fanfold import SyncBatchNorm, revert_sync_batchnorm
from fanfold.collectives.stall import InspectedTransport
from fanfold.distributed.join import FORWARD, DDPParticipant
from fanfold.nn.syncbn import GroupSum
from fanfold.parallel.replicate import LinkedReplicas

OPTIONS = [dict(), dict(affine=False), dict(track_running_stats=False), dict(momentum=None), dict(bias=False),
           dict(eps=1e-3, momentum=0.3)]
SHAPES = [((6, 4), nn.BatchNorm1d), ((6, 4, 5), nn.BatchNorm1d), ((6, 4, 3, 5), nn.BatchNorm2d),
          ((6, 4, 2, 3, 3), nn.BatchNorm3d)]


def _step(bn, x, g):
    x = x.clone().requires_grad_()
    y = bn(x)
    y.backward(g)
    return [y, x.grad] + [p.grad for p in bn.parameters()] + [b.clone() for b in bn.buffers()]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("shape,torch_cls", SHAPES, ids=lambda v: str(v))
def test_alone_it_is_torch_batchnorm_bit_for_bit(shape, torch_cls, options):
    torch.manual_seed(0)
    ref, ours = torch_cls(4, **options), SyncBatchNorm(4, **options)
    ours.load_state_dict(ref.state_dict())
    for step in range(3):  # training steps, then eval
        x, g = torch.randn(*shape) * 3 + 1, torch.randn(*shape)
        for a, b in zip(_step(ref, x, g), _step(ours, x, g)):
            assert torch.equal(a, b), step
    ref.eval(), ours.eval()
    x = torch.randn(*shape)
    assert torch.equal(ref(x), ours(x))


def test_input_errors_name_the_shape():
    with pytest.raises(ValueError, match=r"num_features=4\): the input has 3 channels .*\(5, 3, 2\)"):
        SyncBatchNorm(4)(torch.randn(5, 3, 2))
    with pytest.raises(ValueError, match=r"at least 2 dimensions .*got shape \(4,\)"):
        SyncBatchNorm(4)(torch.randn(4))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        SyncBatchNorm(4)(torch.randn(1, 4))  # plain BatchNorm's own check, alone


def test_torch_syncbatchnorm_state_dict_loads_into_ours_and_back():
    torch.manual_seed(0)
    theirs = nn.SyncBatchNorm(5)
    with torch.no_grad():
        for t in (theirs.weight, theirs.bias, theirs.running_mean):
            t.uniform_()
        theirs.running_var.uniform_(1, 2)
        theirs.num_batches_tracked.fill_(7)
    ours = SyncBatchNorm(5)
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys
    back = nn.SyncBatchNorm(5)
    back.load_state_dict(ours.state_dict())
    for (k, a), (k2, b) in zip(theirs.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    x = torch.randn(3, 5)
    assert torch.equal(theirs.eval()(x), ours.eval()(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(2, 3, 1), nn.BatchNorm1d(3))
        self.bn2 = nn.BatchNorm2d(3, momentum=None)
        self.bn3 = nn.BatchNorm3d(3, affine=False)
        self.torch_sync = nn.SyncBatchNorm(3)

    def forward(self, x):  # x: (N, 2, L)
        h = self.body(x)
        h = self.bn2(h.unsqueeze(-1))
        h = self.bn3(h.unsqueeze(-1))
        return self.torch_sync(h.flatten(2))


def test_convert_shares_parameters_and_buffers_and_revert_restores_torch_classes():
    net = _Net()
    opt_params = list(net.parameters())
    tensors = {k: v for k, v in net.state_dict(keep_vars=True).items()}
    converted = SyncBatchNorm.convert_sync_batchnorm(net, process_group=None)
    kinds = [type(m) for m in (converted.body[1], converted.bn2, converted.bn3, converted.torch_sync)]
    assert kinds == [SyncBatchNorm] * 4
    assert [converted.body[1].converted_from, converted.bn2.converted_from, converted.bn3.converted_from,
            converted.torch_sync.converted_from] == [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, None]
    for k, v in converted.state_dict(keep_vars=True).items():
        assert v is tensors[k], k  # the same objects: an optimizer made before keeps working
    assert list(converted.parameters()) == opt_params
    x = torch.randn(4, 2, 6)
    converted(x)  # a training step (alone: plain BatchNorm) moves the shared running statistics
    assert net.bn2.num_batches_tracked.item() == 1
    reverted = revert_sync_batchnorm(converted)
    kinds = [type(m) for m in (reverted.body[1], reverted.bn2, reverted.bn3, reverted.torch_sync)]
    assert kinds[:3] == [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d]
    assert kinds[3].__name__ == "_BatchNormNd"  # torch's SyncBatchNorm: no dimension recorded
    for k, v in reverted.state_dict(keep_vars=True).items():
        assert v is tensors[k], k
    converted.eval(), reverted.eval()
    assert torch.equal(converted(x), reverted(x))


def test_convert_a_bare_batchnorm_and_refuse_a_lazy_one():
    bn = nn.BatchNorm2d(3)
    new = SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(new) is SyncBatchNorm and new.weight is bn.weight
    assert type(revert_sync_batchnorm(new)) is nn.BatchNorm2d
    with pytest.raises(ValueError, match="lazy BatchNorm .* run one forward"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
    direct = revert_sync_batchnorm(SyncBatchNorm(3))  # built directly: any input dimension
    for shape in ((4, 3), (4, 3, 2), (4, 3, 2, 2), (4, 3, 2, 2, 2)):
        direct(torch.randn(*shape))
    with pytest.raises(TypeError, match="nn.Module"):
        SyncBatchNorm.convert_sync_batchnorm("not a module")


def test_it_takes_part_in_ddp_and_in_dataparallel_and_copies_without_them():
    bn = SyncBatchNorm(3)
    assert isinstance(bn, DDPParticipant) and isinstance(bn, LinkedReplicas)
    assert "SyncBatchNorm" in fanfold.__all__ and "revert_sync_batchnorm" in fanfold.__all__

    class Transport:  # what DDP would hand over: kept by weak reference, never copied or pickled
        pass

    transport = Transport()
    bn.use_transport(transport, None)
    assert bn._transport() is transport
    for copied in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
        assert copied._transport is None and copied.state_dict().keys() == nn.BatchNorm2d(3).state_dict().keys()


def test_under_ddp_it_sums_through_ddps_inspected_transport():
    calls = []

    class Done:
        def wait(self):
            return True

    class Inner:  # a transport that sums as two ranks holding the same vector would
        rank, world_size = 0, 2

        def all_reduce(self, tensor, bucket=None, divisor=None):
            calls.append(bucket)
            tensor.mul_(2)
            return Done()

    inspected = InspectedTransport(Inner(), store=dist.HashStore(), rank=0, world_size=2)
    bn = SyncBatchNorm(3)
    bn.use_transport(inspected, None)
    assert bn._transport() is inspected
    vec = torch.arange(7, dtype=torch.float64)
    out = GroupSum(bn._own_transport, None, "SyncBatchNorm(3)", bn._transport())(vec, FORWARD)
    assert calls == [None] and torch.equal(out, 2 * torch.arange(7, dtype=torch.float64))
    assert inspected._seq == 1  # numbered by the stall inspector: a stall here is diagnosed
    bn.use_transport(inspected, object())
    assert bn._transport is None  # another group than the layer's: its own collectives, not DDP's
