"""On CUDA (`make gpu-check`; skipped without it): DataParallel on every GPU and twice on the first against the bare
module, and torch's and fanfold's DDP over NCCL, one rank per GPU, against one process on the whole batch.
TF32 is off in every process, so that float32 results computed with different batch splits compare closely."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fanfold
from _ddp_models import loss_fn, mlp, optimizer

TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 3

pytestmark = pytest.mark.gpu


@pytest.fixture
def exact_math():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, 8, generator=g)


def _ddp_on_gpu(kind: str) -> list[torch.Tensor]:
    device = fanfold.distributed.init_process_group()  # NCCL, LOCAL_RANK's GPU made current
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp().to(device)
    wrap = fanfold.DistributedDataParallel if kind == "fanfold" else nn.parallel.DistributedDataParallel
    ddp = wrap(model, device_ids=[device])
    opt = optimizer(model)
    for step in range(STEPS):
        x, y = _global_batch(step, world)
        opt.zero_grad()
        loss_fn("mlp", ddp(x[4 * rank: 4 * rank + 4].to(device)), y[4 * rank: 4 * rank + 4].to(device)).backward()
        opt.step()
    dist.destroy_process_group()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["torch", "fanfold"])
def test_ddp_over_nccl_equals_one_process(kind, exact_math):
    world = torch.cuda.device_count()
    model = mlp().cuda()
    opt = optimizer(model)
    for step in range(STEPS):
        x, y = _global_batch(step, world)
        opt.zero_grad()
        loss_fn("mlp", model(x.cuda()), y.cuda()).backward()
        opt.step()
    for params in fanfold.launch(_ddp_on_gpu, kind, nprocs=world, timeout=300):
        for p, q in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach().cpu(), **TOL)


@pytest.mark.parametrize("devices", ["every", "first_twice"])
def test_data_parallel_on_gpus_equals_the_bare_module(devices, exact_math):
    ids = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if devices == "every" else ["cuda:0", "cuda:0"]
    bare = mlp().cuda()
    dp = fanfold.DataParallel(copy.deepcopy(bare), ids)
    x, y = torch.randn(24, 16, device="cuda"), torch.randn(24, 8, device="cuda")
    expected, got = bare(x), dp(x)
    assert got.device == torch.device("cuda:0")
    torch.testing.assert_close(got, expected, **TOL)
    loss_fn("mlp", expected, y).backward()
    loss_fn("mlp", got, y).backward()
    for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
