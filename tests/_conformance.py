"""Models, data and one-process oracles for the DDP conformance tests (a helper module, not a test file): each case
runs torch's own DistributedDataParallel and fanfold's in the same launched ranks, on the same data."""
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fanfold
from fanfold.distributed import TorchTransport

GLOBAL = 8
IMPLS = ("torch", "fanfold/torch", "fanfold/shm")  # torch's DDP; fanfold's over gloo and over shared memory


def wrap(impl: str, model: nn.Module, **kwargs) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notices about static_graph and find_unused_parameters
        if impl == "torch":
            return nn.parallel.DistributedDataParallel(model, **kwargs)
        return fanfold.DDP(model, transport=impl.split("/")[1], **kwargs)


class Checkpointed(nn.Module):
    """a -> b -> c with reentrant activation checkpointing placed by ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        def ck(f, t):
            return checkpoint(f, t, use_reentrant=True)

        def block(t):
            return torch.relu(self.b(t))

        h = torch.relu(self.a(x))
        if self.kind == "last":  # the checkpointed block is the last one: its backward runs first, nested
            return ck(lambda t: self.c(block(t)), h)
        if self.kind == "middle":
            return self.c(ck(block, h))
        if self.kind == "shared":  # b inside the checkpoint and again outside it: two hooks for b's parameters
            return self.c(block(ck(block, h)))
        if self.kind == "twice":  # the same block checkpointed twice
            return self.c(ck(block, ck(block, h)))
        if self.kind == "unused":  # c.bias never used
            return nn.functional.linear(ck(block, h), self.c.weight)
        raise ValueError(self.kind)


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 4, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per: (rank + 1) * per]


def sgd(model: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


def grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def train(ddp: nn.Module, model: nn.Module, steps: int, rank: int, world: int) -> list:
    """Per step, the gradients after backward, or the error's text (and stop)."""
    out = []
    for step in range(steps):
        x, y = data(step)
        model.zero_grad(set_to_none=True)
        try:
            ((ddp(shard(x, rank, world)) - shard(y, rank, world)) ** 2).mean().backward()
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            break
        out.append(grads(model))
        sgd(model)
    return out


def oracle(make, steps: int, world: int = 2) -> list:
    """One process: the mean over ranks of each rank's shard loss (the loss DDP's averaged gradient belongs to)."""
    model = make()
    out = []
    for step in range(steps):
        x, y = data(step)
        model.zero_grad(set_to_none=True)
        loss = sum(((model(shard(x, r, world)) - shard(y, r, world)) ** 2).mean() for r in range(world)) / world
        loss.backward()
        out.append(grads(model))
        sgd(model)
    return out


def close(a: dict, b: dict, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and
                                          torch.allclose(a[k].to_dense(), b[k].to_dense(), atol=atol, rtol=1e-5))
        for k in a)


class Embedder(nn.Module):
    """Sparse gradients: nn.Embedding and nn.EmbeddingBag with sparse=True, and a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.bag = nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens, use_emb=True):
        h = self.emb(tokens).mean(1) if use_emb else torch.zeros(tokens.shape[0], 4)
        return self.out(torch.cat([h, self.bag(tokens)], 1))


def tokens(step: int):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 20, (GLOBAL, 5), generator=g), torch.randn(GLOBAL, 2, generator=g)


class Penalised(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "scalar":  # torch's own test_ddp_create_graph model
            self.p = nn.Parameter(torch.tensor(1.0))
        else:
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x):
        return (self.p.pow(2) * x).sum(1) if self.kind == "scalar" else self.net(x)


def penalty_grads(model: nn.Module, loss: torch.Tensor) -> tuple:
    """The gradient (with a graph), then the gradient of its squared norm (a gradient penalty)."""
    loss.backward(create_graph=True)
    first = grads(model)
    requires = all(p.grad.requires_grad for p in model.parameters())
    pen = sum((p.grad ** 2).sum() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    pen.backward()
    second = grads(model)
    model.zero_grad(set_to_none=True)
    return first, second, requires


class Branchy(nn.Module):
    """``b`` used only when asked; ``never`` used by no rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, use_b=False):
        h = torch.tanh(self.a(x))
        return self.out(h + torch.tanh(self.b(x)) if use_b else h)


class Mixed(nn.Module):
    """For mixed precision: records the dtype its weights have during forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))  # saved for backward as it is (a leaf)
        self.register_buffer("shift", torch.full((4,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.seen = None

    def forward(self, x):
        self.seen = (self.lin1.weight.dtype, x.dtype)
        return self.lin2(torch.tanh(self.lin1(x))) * self.gain + self.shift


def mixed_oracle(param_dtype: torch.dtype, world: int = 2) -> list:
    """Each rank on a low-precision copy of the full-precision masters; gradients averaged in float32; SGD on the
    masters. Step 0: one backward; step 1: two micro-steps (the first under no_sync) accumulated in low precision."""
    import copy

    masters = Mixed()
    out = []
    for step, micro in ((0, 1), (1, 2)):
        replicas = [copy.deepcopy(masters).to(param_dtype) for _ in range(world)]
        for r, rep in enumerate(replicas):
            for m in range(micro):
                x, y = data(step + m)
                ((rep(shard(x, r, world).to(param_dtype)).float() - shard(y, r, world)) ** 2).mean().backward()
        avg = {n: sum(dict(rep.named_parameters())[n].grad.float() for rep in replicas) / world
               for n, _ in masters.named_parameters()}
        out.append(avg)
        with torch.no_grad():
            for n, p in masters.named_parameters():
                p.add_(avg[n], alpha=-0.1)
    return out


class Scaled(nn.Module):
    """A buffer saved for backward (``scale``) and one the forward updates in place (``seen``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        with torch.no_grad():
            self.seen += 1
        return self.lin(x) * self.scale


class Recording(TorchTransport):
    """The torch transport, recording the bucket label of each all-reduce."""

    def __init__(self):
        super().__init__()
        self.buckets = []

    def all_reduce(self, tensor, bucket=None, divisor=None):
        if bucket is not None:
            self.buckets.append(bucket)
        return super().all_reduce(tensor, bucket, divisor)


def branchy_steps(ddp, model, r, n, steps=2, use_b=None):
    """Train a ``Branchy`` through ``ddp``; per step its gradients, or the error's text (and stop). ``use_b``:
    "later" uses ``b`` from the second step on."""
    out = []
    for step in range(steps):
        x, y = data(step)
        model.zero_grad(set_to_none=True)
        flag = (step > 0) if use_b == "later" else bool(use_b)
        try:
            ((ddp(shard(x, r, n), use_b=flag) - shard(y, r, n)) ** 2).mean().backward()
        except RuntimeError as exc:
            out.append(str(exc))
            break
        out.append(grads(model))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
    return out
