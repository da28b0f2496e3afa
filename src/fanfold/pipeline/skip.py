"""Skip connections in a sequential model: ``Stash(name)`` keeps the tensor it passes on, a later
``Pop(stash, merge)`` merges it into its own input. In a plain ``nn.Sequential`` the pair shares one slot; in a
pipeline each micro-batch's stashed tensor goes from the stashing stage to the popping stage's device (through the
channel, its gradient back), whatever stages lie between."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Stash", "Pop", "SkipPlan", "SkipRoute", "plan_skips"]


class _Slot:
    """What a ``Stash`` and its ``Pop`` share: the tensor between them in a plain run."""

    def __init__(self) -> None:
        self.value: Any = None
        self.full = False


class Stash(nn.Module):
    """Passes its input on unchanged and keeps it under ``name`` for the ``Pop`` made from it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError(f"Stash needs a non-empty name, got {name!r}")
        self.name, self._slot = name, _Slot()
        self._route: SkipRoute | None = None  # set by a pipeline's stage around its call

    def forward(self, x: Any) -> Any:
        if self._route is not None:
            self._route.stash(self.name, x)
        elif self._slot.full:
            raise RuntimeError(f"Stash({self.name!r}) ran again before its Pop took the tensor it stashed: every "
                               "stashed tensor must be popped once, later in the same forward")
        else:
            self._slot.value, self._slot.full = x, True
        return x

    def extra_repr(self) -> str:
        return repr(self.name)


def _concat(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, skip], dim=1)


class Pop(nn.Module):
    """``merge(input, the tensor stash stashed)`` (default: concatenated along dim 1, channels)."""

    def __init__(self, stash: Stash, merge: Callable[[Any, Any], Any] = _concat) -> None:
        super().__init__()
        if not isinstance(stash, Stash):
            raise TypeError(f"Pop takes the Stash whose tensor it pops, got {type(stash).__name__}")
        self.name, self._slot, self.merge = stash.name, stash._slot, merge
        self._route: SkipRoute | None = None

    def forward(self, x: Any) -> Any:
        if self._route is not None:
            return self.merge(x, self._route.pop(self.name))
        if not self._slot.full:
            raise RuntimeError(f"Pop({self.name!r}) ran but nothing is stashed under {self.name!r}: its Stash must "
                               "run earlier in the same forward")
        skip, self._slot.value, self._slot.full = self._slot.value, None, False
        return self.merge(x, skip)

    def extra_repr(self) -> str:
        return repr(self.name)


@dataclass(frozen=True)
class SkipPlan:
    """Where each skip starts and ends: ``stash[name]``, ``pop[name]`` are stage indices."""

    stash: dict[str, int] = field(default_factory=dict)
    pop: dict[str, int] = field(default_factory=dict)

    def sends(self, stage: int) -> dict[int, list[str]]:
        """The names stage ``stage`` stashes for another stage, by popping stage."""
        out: dict[int, list[str]] = {}
        for name, s in self.stash.items():
            if s == stage and self.pop[name] != stage:
                out.setdefault(self.pop[name], []).append(name)
        return out

    def receives(self, stage: int) -> dict[int, list[str]]:
        """The names stage ``stage`` pops from another stage, by stashing stage."""
        out: dict[int, list[str]] = {}
        for name, t in self.pop.items():
            if t == stage and self.stash[name] != stage:
                out.setdefault(self.stash[name], []).append(name)
        return out


def plan_skips(layers: Sequence[tuple[str, nn.Module]], balance: Sequence[int]) -> SkipPlan:
    """Each skip's stages; ValueError for a name stashed twice, a Pop before (or without) its Stash, a Stash never
    popped."""
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    stash: dict[str, tuple[int, str]] = {}
    pop: dict[str, tuple[int, str]] = {}
    for i, (name, layer) in enumerate(layers):
        for path, m in layer.named_modules(prefix=name):
            if isinstance(m, Stash):
                if m.name in stash:
                    raise ValueError(f"{path} stashes {m.name!r}, which {stash[m.name][1]} stashes already: one "
                                     "Stash per name")
                stash[m.name] = (i, path)
            elif isinstance(m, Pop):
                if m.name not in stash:
                    raise ValueError(f"{path} pops {m.name!r} but no layer before it stashes {m.name!r}")
                if m.name in pop:
                    raise ValueError(f"{path} pops {m.name!r}, which {pop[m.name][1]} pops already: one Pop per name")
                pop[m.name] = (i, path)
    unpopped = [path for name, (_, path) in stash.items() if name not in pop]
    if unpopped:
        raise ValueError(f"{unpopped[0]} stashes {stash_name(unpopped[0], stash)!r} but no later layer pops it: "
                         "give it a Pop")
    return SkipPlan({n: stage_of[i] for n, (i, _) in stash.items()}, {n: stage_of[i] for n, (i, _) in pop.items()})


def stash_name(path: str, stash: dict[str, tuple[int, str]]) -> str:
    return next(n for n, (_, p) in stash.items() if p == path)


class SkipRoute:
    """One stage's skips for one micro-batch of a pass: what its ``Stash`` layers keep (``stashed``), what its
    ``Pop`` layers take (``popped``: given, received from other stages or stashed here)."""

    def __init__(self, popped: dict[str, Any], recomputing: bool) -> None:
        self.stashed: dict[str, Any] = {}
        self.popped = popped
        self.recomputing = recomputing

    def stash(self, name: str, x: Any) -> None:
        if not self.recomputing:  # a checkpoint's recomputation: the first forward's tensor is the one sent
            self.stashed[name] = x
            self.popped.setdefault(name, x)  # a Pop later in this stage takes it as it is

    def pop(self, name: str) -> Any:
        if name not in self.popped:
            raise RuntimeError(f"Pop({name!r}) ran but its Stash stashed nothing in this micro-batch")
        return self.popped[name]


@contextlib.contextmanager
def routed(module: nn.Module, route: SkipRoute) -> Iterator[None]:
    """Inside, the ``Stash`` and ``Pop`` layers of ``module`` go through ``route`` instead of their slot."""
    layers = [m for m in module.modules() if isinstance(m, (Stash, Pop))]
    saved = [m._route for m in layers]
    for m in layers:
        m._route = route
    try:
        yield
    finally:
        for m, before in zip(layers, saved):
            m._route = before
