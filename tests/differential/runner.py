"""Runs configurations on pools of rank processes (one pool per world size, started at first use and reused) and
keeps the tally the fuzz report is made of: outcomes overall, per drawn keyword or dimension, and every
non-matching configuration with its detail."""
from __future__ import annotations

import collections
import dataclasses
import time

from .compare import Outcome, classify
from .config import DDPConfig, known_defect
from .pool import GRACE, RankPool

TIMEOUT = 120.0  # seconds per configuration (both implementations, every rank); a hang is reported, never waited out
COMPILE_TIMEOUT = 300.0  # torch.compile's first trace in each rank process
COMPILE_GRACE = 60.0  # a peer may still be tracing its graph when another's run raised


def dimensions(config) -> list[str]:
    """The labels a configuration is counted under in the report: its drawn keywords and non-default settings."""
    labels = [f"world={config.world}", f"backend={config.backend}", f"family={config.family}",
              f"dtype={config.dtype}"]
    if isinstance(config, DDPConfig):
        labels.append(f"transport={config.fanfold_transport}")
        labels += [f"{name}={value}" for name, value in config.keywords]
        for field in ("checkpointing", "join", "hook", "lifetime"):
            value = getattr(config, field)
            if value is not None:
                labels.append(f"{field}={value}")
        if config.accumulate > 1:
            labels.append("no_sync accumulation")
        if config.compiled:
            labels.append("torch.compile")
        if config.first_bucket_cap_mb is not None:
            labels.append("first_bucket_cap_mb (fanfold's)")
        labels += [f"output={config.output}", f"optimizer={config.optimizer}"]
    else:
        labels += [f"ZeRO stage {config.stage}", f"optimizer={config.optimizer}"]
    return labels


@dataclasses.dataclass
class Tally:
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_label: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.Counter))
    noteworthy: list = dataclasses.field(default_factory=list)  # (config, outcome) other than match / both-raise
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # why not a plain match
    seconds: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))  # outcome -> [s]
    slowest: list = dataclasses.field(default_factory=list)  # (seconds, outcome kind, config), the SLOWEST

    SLOWEST = 10

    def add(self, config, outcome: Outcome, seconds: float = 0.0) -> None:
        self.outcomes[outcome.kind] += 1
        self.seconds[outcome.kind].append(seconds)
        self.slowest = sorted(self.slowest + [(seconds, outcome.kind, config)], key=lambda t: -t[0])[:self.SLOWEST]
        for label in dimensions(config):
            self.by_label[label][outcome.kind] += 1
        if outcome.kind in ("match-oracle", "both-raise"):
            self.reasons[f"{outcome.kind}: {outcome.detail[:160]}"] += 1
        elif outcome.kind != "match":
            self.noteworthy.append((config, outcome))


class Runner:
    def __init__(self):
        self._pools: dict[int, RankPool] = {}
        self.tallies = {"DDP": Tally(), "ZeRO": Tally()}  # by the kind of configuration

    def run(self, config) -> Outcome:
        start = time.monotonic()
        defect = known_defect(config)
        if defect is not None:
            outcome = Outcome("known-defect", defect)
        else:
            pool = self._pools.get(config.world)
            if pool is None:
                pool = self._pools[config.world] = RankPool(config.world)
            compiled = getattr(config, "compiled", False)
            outcome = classify(config, pool.run(config, COMPILE_TIMEOUT if compiled else TIMEOUT,
                                                COMPILE_GRACE if compiled else GRACE))
        self.tallies["DDP" if isinstance(config, DDPConfig) else "ZeRO"].add(config, outcome, time.monotonic() - start)
        return outcome

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
