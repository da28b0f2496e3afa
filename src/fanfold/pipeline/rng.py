"""Random numbers in a pipeline: each (micro-batch, stage) cell draws from a generator seeded from (the pass's seed,
stage, micro-batch), so a recomputation draws its forward's masks whatever the schedule, threads or processes. Cells
on a shared generator take a lock per pass."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["StageRandom", "draws_random_numbers", "pass_seed", "stage_randoms"]

_MASK = (1 << 64) - 1
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def draws_random_numbers(module: nn.Module) -> bool:
    """True if ``module`` holds a layer known to draw random numbers in its current mode (dropout in training)."""
    return any(m.training and ((isinstance(m, _RANDOM) and m.p > 0) or isinstance(m, nn.RReLU) or
                               (isinstance(m, nn.MultiheadAttention) and m.dropout > 0))
               for m in module.modules())


def pass_seed() -> int:
    """A pass's seed: one draw from the caller's CPU generator, so ``torch.manual_seed`` fixes a pass's masks."""
    return int(torch.randint(1 << 62, (), dtype=torch.int64))


def cell_seed(seed: int, stage: int, microbatch: int) -> int:
    """splitmix64 of the pass seed and the cell's position: the CPU generator keeps only a seed's low 32 bits, so
    every bit of the result must depend on every input bit."""
    z = (seed + 0x9E3779B97F4A7C15 * (1 + (stage << 32) + microbatch)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


@dataclass
class StageRandom:
    """Stage ``stage``'s random numbers in a pass seeded ``seed``, on ``device``'s generator. ``lock``: shared by the
    stages on that generator, else None. ``drew``: whether a cell of this stage drew in this pass."""

    seed: int
    stage: int
    device: torch.device
    lock: threading.RLock | None = None
    drew: bool = field(default=False, compare=False)

    @contextlib.contextmanager
    def cell(self, microbatch: int) -> Iterator[None]:
        """Micro-batch ``microbatch``'s draws, the same each time this is entered (forward, then recomputation)."""
        with self.lock if self.lock is not None else contextlib.nullcontext():
            saved = _get_state(self.device)
            seeded = torch.Generator(self.device).manual_seed(cell_seed(self.seed, self.stage, microbatch))
            seeded = seeded.get_state()
            _set_state(self.device, seeded)
            try:
                yield
                self.drew = self.drew or not torch.equal(_get_state(self.device), seeded)
            finally:
                # the caller's generator continues where it was, whatever the cells drew
                _set_state(self.device, saved)


def stage_randoms(seed: int, devices: Sequence[torch.device], first: int, controlled: bool,
                  may_draw: Sequence[bool] | None = None) -> list[StageRandom | None]:
    """Each stage's ``StageRandom`` for a pass (None: left alone), stages ``first``... on ``devices``. ``controlled``:
    a stage recomputes or holds a known random layer; ``may_draw`` (default: all): the stages that need one."""
    may_draw = [controlled] * len(devices) if may_draw is None else [controlled and d for d in may_draw]
    drawing = [d for d, m in zip(devices, may_draw) if m]
    locks = {d: threading.RLock() for d in set(drawing) if drawing.count(d) > 1}
    return [StageRandom(seed, first + s, d, locks.get(d)) if m else None
            for s, (d, m) in enumerate(zip(devices, may_draw))]
