"""``DistributedSampler``: torch's order, its own epochs, a mid-epoch resume at any world size; ``gather_evaluation``:
every rank's evaluation results in dataset order, each sample once.
"""
from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from .._core.job import rank_world
from ..collectives.objects import all_gather_object
from ..collectives.stall import group_transport

__all__ = ["DistributedSampler", "gather_evaluation"]


class DistributedSampler(Sampler[int]):
    """Each rank's share of a seeded per-epoch order; every new ``iter()`` is the next epoch (``set_epoch`` works too).

    ``even=True`` (training) pads with the epoch's first samples so every rank gets the same count, or with
    ``drop_last=True`` drops the tail; ``even=False`` (evaluation) pads nothing. ``state_dict()`` records the epoch and
    this rank's handed-out count times ``num_replicas`` (the ranks step together); a ``DataLoader`` with workers
    fetches ahead, so then call ``set_consumed(batches_done * batch_size)`` before ``state_dict()``.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, even: bool = True) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must have a length, got {type(dataset).__name__}")
        default_rank, default_world = rank_world()
        num_replicas = default_world if num_replicas is None else num_replicas
        rank = default_rank if rank is None else rank
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank!r}")
        if drop_last and not even:
            raise ValueError("drop_last=True evens the ranks out by dropping samples; it contradicts even=False")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.even = shuffle, int(seed), drop_last, even
        self.epoch = 0
        self._next = (0, 0)  # (epoch, first global position) of the next iter()
        self._pending = True  # no iter() since construction, set_epoch or load_state_dict
        self._iter = (0, 0)  # (epoch, first global position) of the current or last iter()
        self._yielded = 0
        self._told: int | None = None
        self._iterated = False

    def _order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def _positions(self, epoch: int, start: int, num_replicas: int) -> list[int]:
        """The global order from position ``start``, padded or cut so that it splits as the flags say."""
        order = self._order(epoch)
        rest = order[start:]
        if self.drop_last:
            return rest[: len(rest) // num_replicas * num_replicas]
        need = -len(rest) % num_replicas if self.even else 0
        if need and order:
            # Pad from the epoch's first samples, as torch does: a resumed epoch pads exactly as an uninterrupted one.
            rest += (order * (need // len(order) + 1))[:need]
        return rest

    def _share(self, start: int, rank: int) -> int:
        """How many indices ``rank`` gets from an order resumed at ``start`` (no permutation drawn)."""
        left, r = len(self.dataset) - start, self.num_replicas
        if self.drop_last:
            return left // r
        return -(-left // r) if self.even else len(range(rank, left, r))

    def indices(self, rank: int | None = None) -> list[int]:
        """Dataset indices that ``rank`` (default: this one) got in the current or last ``iter()``."""
        rank = self.rank if rank is None else rank
        epoch, start = self._iter
        return self._positions(epoch, start, self.num_replicas)[rank::self.num_replicas]

    def __len__(self) -> int:
        """Samples this rank gets in a whole epoch (a resumed epoch gives fewer)."""
        return self._share(0, self.rank)

    def __iter__(self) -> Iterator[int]:
        epoch, start = self._next
        self._next, self._pending = (epoch + 1, 0), False
        self.epoch, self._iter, self._yielded, self._told = epoch, (epoch, start), 0, None
        self._iterated = True
        return self._count(self.indices())

    def _count(self, mine: list[int]) -> Iterator[int]:
        for index in mine:
            self._yielded += 1  # counted when handed out: a batch in the loop's hands is consumed
            yield index

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` is ``epoch``; a resume point loaded for that same epoch is kept."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._next = (epoch, self._next[1] if self._next[0] == epoch and self._pending else 0)
        self._pending, self.epoch = True, epoch

    def set_consumed(self, samples: int) -> None:
        """This rank's loop has finished ``samples`` samples of the current ``iter()`` (overrides the count)."""
        share = self._share(self._iter[1], self.rank)
        if not isinstance(samples, int) or not 0 <= samples <= share:
            raise ValueError(f"samples must be in [0, {share}] for rank {self.rank}, got {samples!r}")
        self._told = samples

    def state_dict(self) -> dict[str, Any]:
        if self._pending:
            epoch, consumed = self._next
        else:
            epoch, start = self._iter
            done = self._yielded if self._told is None else self._told
            if done >= self._share(start, self.rank):
                epoch, consumed = epoch + 1, 0
            else:
                consumed = start + done * self.num_replicas
        return {"epoch": epoch, "consumed": consumed, "num_samples": len(self.dataset), "seed": self.seed,
                "shuffle": self.shuffle, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off: the next ``iter()`` continues its epoch (any world size)."""
        for key in ("epoch", "consumed", "num_samples", "seed", "shuffle"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}: {state!r:.200}")
        n = len(self.dataset)
        for key, mine in (("num_samples", n), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler {mine!r}: "
                                 f"the resumed order would differ")
        epoch, consumed = state["epoch"], state["consumed"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(consumed, int) and 0 <= consumed <= n):
            raise ValueError(f"sampler state has epoch={epoch!r}, consumed={consumed!r}; need 0 <= consumed <= {n}")
        self._next = (epoch + 1, 0) if consumed == n and n else (epoch, consumed)
        self._pending, self.epoch = True, self._next[0]


def gather_evaluation(values: torch.Tensor, sampler: DistributedSampler) -> torch.Tensor:
    """Every rank's evaluation results, one row per distinct sample, in dataset order (collective). ``values[i]``: this
    rank's result for the ``i``-th index its ``sampler`` handed out in its last ``iter()``; padding duplicates collapse
    into one row, samples dropped by ``drop_last`` give none."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a tensor with one row per sample, got {type(values).__name__}")
    if not isinstance(sampler, DistributedSampler):
        raise TypeError(f"sampler must be a fanfold.data.DistributedSampler, got {type(sampler).__name__}")
    world = rank_world(from_env=False)[1]
    if world != sampler.num_replicas:
        raise ValueError(f"the sampler splits over {sampler.num_replicas} replicas, the process group has {world}")
    if not sampler._iterated:
        raise ValueError("iterate the sampler (run the evaluation loop) before gathering its results")
    local = values.detach().cpu()
    parts = all_gather_object(local, transport=group_transport(None, "gather_evaluation")) if world > 1 else [local]
    n = len(sampler.dataset)
    out = torch.empty((n, *local.shape[1:]), dtype=local.dtype)
    seen = torch.zeros(n, dtype=torch.bool)
    for rank, part in enumerate(parts):
        idx = torch.tensor(sampler.indices(rank), dtype=torch.long)
        if len(part) != len(idx):
            raise ValueError(f"rank {rank} gave {len(part)} results for the {len(idx)} indices its sampler handed out")
        out[idx] = part
        seen[idx] = True
    return out[seen].to(values.device)
