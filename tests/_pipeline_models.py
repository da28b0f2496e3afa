"""Models, batches and the single-process oracle for the pipeline tests, and the functions their ranks run.

A helper module, not a test file: ``fanfold.launch`` imports the rank functions by name. The oracle is always the
plain sequential model on one thread (``sequential_step``): its output, loss and gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import fanfold
import fanfold.distributed


def mlp(seed: int = 0, width: int = 24) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width),
        nn.Tanh(), nn.Linear(width, 4),
    ).double()


class Embed(nn.Module):
    """Token ids -> (hidden states, padding mask): hands a tuple with a bool tensor to the next layer."""

    def __init__(self, vocab: int = 30, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.emb(tokens), tokens == 0


class Block(nn.Module):
    """A transformer encoder block on a (hidden states, padding mask) tuple."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, pad = x
        return self.layer(h, src_key_padding_mask=pad), pad


class Head(nn.Module):
    def __init__(self, d: int = 16, out: int = 4):
        super().__init__()
        self.proj = nn.Linear(d, out)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, pad = x
        return self.proj(h.masked_fill(pad.unsqueeze(-1), 0.0).mean(dim=1))


def transformer(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Embed(), Block(), Block(), Block(), Head()).double()


MODELS = {"mlp": mlp, "transformer": transformer}


def batch(kind: str, rows: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "transformer":
        tokens = torch.randint(1, 30, (rows, 6), generator=g)
        tokens[::3, 4:] = 0  # some padding
        return tokens, torch.randn(rows, 4, generator=g, dtype=torch.float64)
    return torch.randn(rows, 8, generator=g, dtype=torch.float64), torch.randn(rows, 4, generator=g,
                                                                                dtype=torch.float64)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def sequential_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The oracle: (output, loss, gradients by parameter name) of the plain model on the whole batch."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = mse(out, y)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def sgd(module: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
            p.grad = None


# ---- functions the ranks run (fanfold.launch) ----------------------------------------------------------------
def stage_per_process(kind: str, balance: list, chunks: int, checkpoint: str, steps: int) -> dict:
    """Each rank one stage; both schedules for ``steps`` SGD steps each; returns this rank's losses and weights."""
    fanfold.distributed.init_process_group(timeout=120)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = fanfold.DistributedPipeline(MODELS[kind](), balance, chunks, checkpoint)
        losses = []
        for step in range(steps):
            x, y = batch(kind, seed=step)
            losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, mse,
                                          schedule=schedule).item())
            if step == 0:
                out[schedule, "grads"] = grads(pipe)
            sgd(pipe)
        out[schedule, "losses"] = losses
        out[schedule, "state"] = {k: v.clone() for k, v in pipe.state_dict().items()}
        with torch.no_grad():
            evaluated = pipe(batch(kind, seed=99)[0] if pipe.is_first else None)
        out[schedule, "eval"] = evaluated
    return out


def pipelines_in_ddp(kind: str, steps: int) -> dict:
    """Each rank an in-process 2-stage Pipeline on its half of the batch; gradients averaged over the ranks, by
    ``train_step(data_parallel_group=...)`` and, in a second model, by fanfold's DDP around a plain backward."""
    fanfold.distributed.init_process_group(timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    explicit = fanfold.Pipeline(MODELS[kind](seed=rank), [4, 3] if kind == "mlp" else [2, 3], ["cpu", "cpu"],
                                chunks=3, data_parallel_group="world")  # seed=rank: the broadcast must fix it
    plain = fanfold.DistributedDataParallel(
        fanfold.Pipeline(MODELS[kind](), [4, 3] if kind == "mlp" else [2, 3], ["cpu", "cpu"], chunks=3))
    losses = {"explicit": [], "plain": []}
    for step in range(steps):
        x, y = batch(kind, rows=12, seed=step)
        mine = slice(rank * 12 // world, (rank + 1) * 12 // world)
        losses["explicit"].append(explicit.train_step(x[mine], y[mine], mse, schedule="1f1b").item())
        sgd(explicit)
        loss = mse(plain(x[mine]), y[mine])
        loss.backward()
        losses["plain"].append(loss.item())
        sgd(plain)
    return {"losses": losses, "explicit": explicit.state_dict(), "plain": plain.state_dict()}


def pipelines_over_processes(kind: str, steps: int) -> dict:
    """4 ranks: 2 pipelines of 2 stages, each pipeline on its half of the batch."""
    fanfold.distributed.init_process_group(timeout=120)
    # pipeline 1 is built from another seed: the broadcast from pipeline 0 must fix it
    pipe = fanfold.DistributedPipeline(MODELS[kind](seed=dist.get_rank() // 2 * 5), "auto", chunks=2, stages=2)
    losses = []
    for step in range(steps):
        x, y = batch(kind, rows=12, seed=step)
        half = slice(pipe.data_parallel_rank * 6, (pipe.data_parallel_rank + 1) * 6)
        losses.append(pipe.train_step(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None, mse,
                                      schedule="1f1b").item())
        sgd(pipe)
    return {"losses": losses, "state": pipe.state_dict(), "stage": pipe.stage, "dp": pipe.data_parallel_rank}


def skip_model(seed: int = 0) -> nn.Sequential:
    """An MLP with two skip connections (``Stash``/``Pop``), one popped by adding, one by concatenating."""
    from fanfold.pipeline import Pop, Stash

    torch.manual_seed(seed)
    a, b = Stash("a"), Stash("b")
    return nn.Sequential(
        nn.Linear(8, 8), a, nn.Tanh(), nn.Linear(8, 8), b, nn.Tanh(), nn.Linear(8, 8),
        Pop(b, lambda x, s: x + 2 * s), nn.Tanh(), Pop(a), nn.Linear(16, 4),
    ).double()


def skips_per_process(balance: list, chunks: int, checkpoint: str) -> dict:
    """Each rank one stage of ``skip_model``; both schedules; this rank's loss and gradients."""
    fanfold.distributed.init_process_group(timeout=120)
    out = {}
    x, y = batch("mlp", rows=13)
    for schedule in ("gpipe", "1f1b"):
        pipe = fanfold.DistributedPipeline(skip_model(), balance, chunks, checkpoint)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, mse, schedule=schedule)
        out[schedule] = (loss.item(), grads(pipe))
    return out
