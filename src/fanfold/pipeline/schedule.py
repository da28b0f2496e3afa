"""Pipeline schedules, ``(stages, microbatches) -> clock cycles`` of :class:`Step` (``gpipe``, ``one_f_one_b``), and
``clocked``: per-stage orders into cycles, the check that an order cannot deadlock."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["Step", "gpipe", "one_f_one_b", "clocked", "stage_orders"]

Phase = Literal["F", "B"]


@dataclass(frozen=True)
class Step:
    """Stage ``stage`` runs the forward (``phase="F"``) or backward (``"B"``) of micro-batch ``microbatch``."""

    stage: int
    microbatch: int
    phase: Phase

    def __repr__(self) -> str:
        return f"{self.phase}{self.microbatch}@{self.stage}"


def _check(stages: int, microbatches: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def gpipe(stages: int, microbatches: int) -> Iterator[list[Step]]:
    """GPipe: forwards on the diagonal clock ``k = stage + microbatch``, then backwards in reverse."""
    _check(stages, microbatches)
    for k in range(stages + microbatches - 1):
        yield [Step(s, k - s, "F") for s in range(stages) if 0 <= k - s < microbatches]
    for k in range(stages + microbatches - 1):
        # the last stage starts with the last micro-batch, whose activations are the freshest
        yield [Step(s, microbatches - 1 - (k - (stages - 1 - s)), "B")
               for s in reversed(range(stages)) if 0 <= k - (stages - 1 - s) < microbatches]


def one_f_one_b(stages: int, microbatches: int) -> Iterator[list[Step]]:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    _check(stages, microbatches)
    orders = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        order = [Step(s, m, "F") for m in range(warmup)]
        for m in range(warmup, microbatches):
            order += [Step(s, m, "F"), Step(s, m - warmup, "B")]
        orders.append(order + [Step(s, m, "B") for m in range(microbatches - warmup, microbatches)])
    yield from clocked(orders)


def clocked(orders: list[list[Step]]) -> Iterator[list[Step]]:
    """Clock cycles from per-stage orders: each cycle, every stage takes its next step if its inputs are ready
    (F(s, m) needs F(s - 1, m); B(s, m) needs F(s, m) and B(s + 1, m)). ValueError naming the stuck steps if the
    orders cannot complete."""
    stages = len(orders)
    done: set[tuple[int, int, str]] = set()
    position = [0] * stages

    def ready(step: Step) -> bool:
        s, m = step.stage, step.microbatch
        if step.phase == "F":
            return s == 0 or (s - 1, m, "F") in done
        return (s, m, "F") in done and (s == stages - 1 or (s + 1, m, "B") in done)

    while any(position[s] < len(orders[s]) for s in range(stages)):
        cycle = [orders[s][position[s]] for s in range(stages)
                 if position[s] < len(orders[s]) and ready(orders[s][position[s]])]
        if not cycle:
            stuck = [orders[s][position[s]] for s in range(stages) if position[s] < len(orders[s])]
            raise ValueError(f"schedule deadlocks: no stage can run its next step {stuck}")
        for step in cycle:
            done.add((step.stage, step.microbatch, step.phase))
            position[step.stage] += 1
        yield cycle


def stage_orders(schedule: Iterable[Iterable[Step]], stages: int, microbatches: int) -> list[list[Step]]:
    """Each stage's steps in schedule order, checked: every (stage, micro-batch, phase) exactly once, no deadlock."""
    orders: list[list[Step]] = [[] for _ in range(stages)]
    seen: set[Step] = set()
    for cycle in schedule:
        for step in cycle:
            if not isinstance(step, Step):
                raise TypeError(f"a schedule yields lists of Step, got {type(step).__name__}: {step!r}")
            if not (0 <= step.stage < stages and 0 <= step.microbatch < microbatches and step.phase in ("F", "B")):
                raise ValueError(f"schedule step {step!r} is outside {stages} stages x {microbatches} micro-batches")
            if step in seen:
                raise ValueError(f"schedule runs {step!r} twice")
            seen.add(step)
            orders[step.stage].append(step)
    missing = [Step(s, m, p) for s in range(stages) for m in range(microbatches) for p in "FB"
               if Step(s, m, p) not in seen]
    if missing:
        raise ValueError(f"schedule never runs {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    for _ in clocked(orders):  # raises on a deadlock
        pass
    return orders


ScheduleFn = Callable[[int, int], Iterable[Iterable[Step]]]
_SCHEDULES: dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def resolve(schedule: str | ScheduleFn) -> ScheduleFn:
    if callable(schedule):
        return schedule
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(_SCHEDULES)} or a function (stages, microbatches) -> "
                         f"clock cycles of Step, got {schedule!r}")
    return _SCHEDULES[schedule]
