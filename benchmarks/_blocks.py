"""Shared by the benchmarks that compare rows inside the same processes: a training step, and timing in alternating
blocks.

This VM's speed drifts by tens of per cent from one second to the next, so rows timed in separate launches are
compared under different machines. Here every row's model lives in the same ranks and the rows take turns: blocks of
``block`` steps, the order rotated each round so that no row always goes first, a barrier before each block, and a
block's time is the slowest rank's (the ranks agree on it). A row may finish each block with work of its own that
belongs to its steps (``finish``: e.g. waiting for collectives its last step left in flight), inside the clock, so
that nothing of one row runs during another row's block. A ratio between two rows is then taken round by round
(``same_round_ratios``) and summarised by its median.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["train_step", "time_blocks", "same_round_ratios"]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One classification training step on a fixed batch: forward, cross-entropy, zero_grad, backward, step."""

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def time_blocks(steps: dict[str, Callable[[], None]], block: int, blocks: int,
                finish: dict[str, Callable[[], None]] | None = None) -> dict[str, list[float]]:
    """Seconds per step of each row's blocks, in round order: the slowest rank's, the same list on every rank.
    ``finish[row]``, where given, runs after the row's last step of each block, timed with the block."""
    rows, finish = list(steps), finish or {}
    times: dict[str, list[float]] = {row: [] for row in rows}
    slowest = torch.zeros(1, dtype=torch.float64)
    for i in range(blocks):
        k = i % len(rows)
        for row in rows[k:] + rows[:k]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(block):
                steps[row]()
            if row in finish:
                finish[row]()
            slowest[0] = (time.perf_counter() - start) / block
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[row].append(float(slowest[0]))
    return times


def same_round_ratios(times: dict[str, list[float]], row: str, base: str) -> list[float]:
    """``row``'s block time over ``base``'s of the same round, for every round."""
    return [t / b for t, b in zip(times[row], times[base])]
