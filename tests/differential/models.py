"""The model families and the data the differential DDP tests draw from (no DDP in here).

One ``Net`` class shaped by its family: an MLP, conv + BatchNorm, dense or sparse embeddings, a branch used only on
some ranks or steps (or never), tied weights, a buffer used and updated by the forward. Orthogonal to the family:
frozen parameters, a block under activation checkpointing (reentrant or not), and a tuple or dict output. The data
of each (rank, step, micro-step) comes from its own seeded generator, so every rank, and a one-process oracle, can
rebuild any rank's batch.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

FAMILIES = ("mlp", "conv_bn", "embedding", "sparse_embedding", "branch_rank", "branch_step", "branch_never",
            "tied", "buffers")
WIDTH, OUT, VOCAB, PER_RANK = 6, 3, 12, 4


class Net(nn.Module):
    """``a`` (family-specific input layer) -> ``b`` (a hidden block, optionally checkpointed) -> ``head``."""

    def __init__(self, family: str, checkpointing: str | None = None, output: str = "tensor",
                 frozen: bool = False):
        super().__init__()
        self.family, self.checkpointing, self.output = family, checkpointing, output
        if family == "conv_bn":
            # no bias before BatchNorm: its gradient would be zero but for rounding, and Adam scales that up
            self.a = nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(12, WIDTH))
        elif family in ("embedding", "sparse_embedding"):
            sparse = family == "sparse_embedding"
            self.a = nn.Embedding(VOCAB, WIDTH, sparse=sparse)
            self.bag = nn.EmbeddingBag(VOCAB, WIDTH, mode="sum", sparse=sparse)
        else:
            self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        if family.startswith("branch"):
            self.side = nn.Linear(WIDTH, WIDTH)
        if family == "buffers":
            self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.head = nn.Linear(WIDTH, OUT)
        if family == "tied":  # one Parameter under two names: `a` and `back` share a weight
            self.back = nn.Linear(WIDTH, WIDTH, bias=False)
            self.back.weight = self.a.weight
        if frozen:
            self.b[0].bias.requires_grad_(False)
            self.head.bias.requires_grad_(False)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return self.b(h)
        return checkpoint(self.b, h, use_reentrant=self.checkpointing == "reentrant")

    def forward(self, x: torch.Tensor, use_side: bool = True):
        if self.family in ("embedding", "sparse_embedding"):
            h = self.a(x).mean(1) + self.bag(x)
        else:
            h = torch.tanh(self.a(x))
        if self.family == "tied":
            h = torch.tanh(self.back(h))
        if self.family == "buffers":
            h = h * self.scale
            with torch.no_grad():  # a buffer the forward changes: broadcast_buffers syncs it from rank 0
                self.calls += 1
                self.scale.mul_(0.99)
        h = self._block(h)
        if self.family.startswith("branch") and use_side:
            h = h + torch.tanh(self.side(h))
        y = self.head(h)
        if self.output == "tuple":
            return y, h.sum(1)
        if self.output == "dict":
            return {"y": y, "aux": h.sum(1), "rank_free": "a non-tensor leaf"}
        return y


def uses_side(family: str, rank: int, step: int) -> bool:
    """Whether the branch ``side`` takes part: unused on odd ranks, on odd steps, or never."""
    if family == "branch_rank":
        return rank % 2 == 0
    if family == "branch_step":
        return step % 2 == 0
    return family != "branch_never"


def build(family: str, dtype: torch.dtype, seed: int, checkpointing: str | None = None, output: str = "tensor",
          frozen: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(family, checkpointing, output, frozen).to(dtype)


def batch(family: str, dtype: torch.dtype, seed: int, rank: int, step: int, micro: int = 0):
    """This rank's (input, target) of one micro-step: every rank draws its own."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + step * 1009 + micro)
    if family in ("embedding", "sparse_embedding"):
        x = torch.randint(0, VOCAB, (PER_RANK, 3), generator=g)
    elif family == "conv_bn":
        x = torch.randn(PER_RANK, 2, 4, 4, generator=g, dtype=torch.float64).to(dtype)
    else:
        x = torch.randn(PER_RANK, WIDTH, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.randn(PER_RANK, OUT, generator=g, dtype=torch.float64).to(dtype)


def loss_of(out, y: torch.Tensor) -> torch.Tensor:
    """Every floating output takes part: the main one against the target, the auxiliary ones a little."""
    if isinstance(out, tuple):
        return F.mse_loss(out[0].to(y.dtype), y) + 0.1 * out[1].to(y.dtype).pow(2).mean()
    if isinstance(out, dict):
        return F.mse_loss(out["y"].to(y.dtype), y) + 0.1 * out["aux"].to(y.dtype).pow(2).mean()
    return F.mse_loss(out.to(y.dtype), y)
