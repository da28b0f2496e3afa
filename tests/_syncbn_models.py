"""A small BatchNorm CNN, its data, and the one-process oracle for the SyncBatchNorm tests (a helper module).

The oracle is plain torch BatchNorm applied to the whole batch of each step (every part's samples, concatenated)
in one process, trained with the mean loss over that batch. A part (rank or replica) of ``n`` samples out of the
step's ``total`` contributes ``sum of its samples' losses * world / total``: DDP averages over ``world`` ranks, so
its gradients are the whole batch's mean-loss gradients.
"""
from __future__ import annotations

import torch
from torch import nn

from _ddp_models import SGD

STEPS = 10


def cnn() -> nn.Module:
    """BatchNorm2d (default), BatchNorm2d with momentum=None (cumulative average), BatchNorm1d without affine.
    The layers before a BatchNorm have no bias, as in any BatchNorm network: its gradient would be zero but for
    rounding, noise that no tolerance relative to the gradients can compare."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16, affine=False),
        nn.ReLU(), nn.Linear(16, 4),
    )


def step_batch(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``: inputs far from zero mean (the statistics must not cancel), targets."""
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(total, 3, 6, 6, generator=g) * 2 + 3, torch.randn(total, 4, generator=g)


def part(t: torch.Tensor, sizes: list[int], index: int) -> torch.Tensor:
    start = sum(sizes[:index])
    return t[start: start + sizes[index]]


def part_loss(out: torch.Tensor, y: torch.Tensor, total: int, world: int) -> torch.Tensor:
    return ((out - y) ** 2).sum() * (world / total)


def train(model: nn.Module, call, batches) -> dict:
    """SGD with momentum on ``part_loss(call(x), y, total, world)`` for each ``(x, y, total, world)`` of
    ``batches``: the first step's output and gradients (``model``'s parameters) and the final state, on the CPU."""
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
    out: dict = {}
    for step, (x, y, total, world) in enumerate(batches):
        opt.zero_grad()
        o = call(x)
        part_loss(o, y.to(o.device), total, world).backward()
        if step == 0:
            out["out0"] = o.detach().cpu()
            out["grads0"] = [p.grad.cpu() for p in model.parameters()]
        opt.step()
    out["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return out


def oracle(schedule: list[list[int]]) -> dict:
    """``train`` of ``cnn()`` with plain BatchNorm on each step's whole batch (``schedule[step]``: every part's
    size), with the mean loss over that batch."""
    model = cnn()
    totals = [sum(sizes) for sizes in schedule]
    return train(model, model, ((*step_batch(step, total), total, 1) for step, total in enumerate(totals)))


def assert_matches(got: dict, want: dict, sizes0: list[int] | None = None, index: int = 0) -> None:
    """``got`` (one part's record: its rows of the first output, the gradients, the state) against the oracle,
    to 1e-5 relative to the largest magnitude of the tensor (for a gradient or a parameter: of all of them). Sums
    taken in another order (per part, then over parts) differ by a few ulps of their largest terms, more than 1e-5
    of an element near zero, and ten SGD steps with momentum carry such differences from one tensor to another."""

    def close(a: torch.Tensor, b: torch.Tensor, what: str, scale: float) -> None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale + 1e-7, msg=lambda m: f"{what}: {m}")

    def biggest(ts) -> float:
        return max((t.abs().max().item() for t in ts if t.is_floating_point() and t.numel()), default=0.0)

    if sizes0 is not None:
        b = part(want["out0"], sizes0, index)
        close(got["out0"], b, "first output", biggest([b]))
    scale = biggest(want["grads0"])
    for i, (a, b) in enumerate(zip(got["grads0"], want["grads0"])):
        close(a, b, f"gradient of parameter {i}", scale)
    assert got["state"].keys() == want["state"].keys()
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    scale = biggest([b for k, b in want["state"].items() if not k.endswith(buffers)])
    for k, b in want["state"].items():
        close(got["state"][k], b, k, biggest([b]) if k.endswith(buffers) else scale)
