"""Which parameters are ready in one synchronised backward: each once, or (``static_graph``) as often as in the first.

No collectives here. A parameter is *ready* when autograd has finished accumulating its gradient for this backward,
and its bucket can then be reduced; a second hook for the same parameter is torch's error, unless ``static_graph``
counted it in the first backward. The rules and why: docs/ddp.md, "Design notes".
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Readiness", "marked_twice_message", "unfinished_message"]


def marked_twice_message(rank: int, name: str) -> str:
    return (f"DistributedDataParallel (rank {rank}): Expected to mark a variable ready only once: parameter {name!r} "
            "has been marked as ready twice (it got a second gradient in this backward, after its bucket could "
            "already be reduced). Typical causes: a block checkpointed with use_reentrant=True whose parameters are "
            "also used outside it, or a block checkpointed twice; a parameter used outside forward. Pass "
            "static_graph=True to DistributedDataParallel if the model uses the same parameters the same number of "
            "times in every iteration, or checkpoint with use_reentrant=False.")


# torch's words for a reduction a backward left unfinished (raised at the next forward), which torch's own tests match
_UNFINISHED = "Expected to have finished reduction in the prior iteration before starting a new one. "
_UNUSED = ("This error indicates that your module has parameters that were not used in producing loss. You can enable "
           "unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
           "`torch.nn.parallel.DistributedDataParallel`, and by making sure all `forward` function outputs participate "
           "in calculating loss (or set requires_grad=False on parameters you never train).")
_STATIC = ("This error indicates that your training graph has changed in this iteration, e.g., one parameter is used "
           "in first iteration, but then got unused in the second iteration. this is not compatible with static_graph "
           "set to True.")


def unfinished_message(rank: int, indices: list[int], names: list[str], static: bool = False,
                       detail: str = "") -> str:
    """The error of the forward after a backward whose reduction could not finish: parameters that got no gradient
    without find_unused_parameters, or fewer than a static graph's first iteration gave them. torch's words, the
    parameters' indices (torch's) and names, which fanfold gives whatever TORCH_DISTRIBUTED_DEBUG says."""
    return (f"DistributedDataParallel (rank {rank}): {_UNFINISHED}{_STATIC if static else _UNUSED}\n"
            f"Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, indices))}\n"
            f"Parameters which did not receive grad for rank {rank}: {', '.join(names)}{detail}\n"
            "(fanfold names them whatever the environment says; torch's DDP asks you to set the environment "
            "variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to see them.) That backward left every "
            ".grad as this rank computed it, un-averaged, as torch's DDP does; no forward with grad runs until this "
            "DistributedDataParallel is built again.")


class Readiness:
    """Readiness of ``len(names)`` parameters across one synchronised backward."""

    def __init__(self, names: Sequence[str], rank: int, static_graph: bool = False):
        self.names, self.rank, self.static = list(names), rank, bool(static_graph)
        self.expected: list[int] | None = None  # static_graph: hooks per parameter in the first iteration
        self.reset()

    def reset(self) -> None:
        n = len(self.names)
        self.ready = [False] * n
        self.counts = [0] * n
        self.order: list[int] = []

    @property
    def counting(self) -> bool:
        """The first synchronised backward of a static graph: count, reduce nothing until its end."""
        return self.static and self.expected is None

    @property
    def static_unused(self) -> list[int]:
        """Parameters the first iteration of a static graph never reached (empty before it, or without one)."""
        return [] if self.expected is None else [i for i, c in enumerate(self.expected) if c == 0]

    def hook(self, i: int, loose: bool = False) -> bool:
        """Parameter ``i``'s gradient hook fired: whether it became ready now. Raises RuntimeError when the hook is
        one too many. ``loose``: once, whatever the static graph says (the backward of a create_graph backward)."""
        self.counts[i] += 1
        if self.static and not loose:
            if self.expected is None:  # counting
                if self.counts[i] == 1:
                    self.order.append(i)  # the first-seen order: what the buckets are rebuilt from
                return False
            if self.counts[i] > self.expected[i]:
                raise RuntimeError(self._changed(i))
            if self.counts[i] < self.expected[i]:
                return False
        if self.ready[i]:
            raise RuntimeError(marked_twice_message(self.rank, self.names[i]))
        self.ready[i] = True
        self.order.append(i)
        return True

    def mark(self, i: int) -> None:
        self.ready[i] = True
        self.order.append(i)

    def learn(self) -> None:
        """End of the first synchronised backward of a static graph: its counts become the expected ones."""
        self.expected = list(self.counts)

    def short(self) -> list[int]:
        """Parameters that reached fewer hooks than the static graph expects (after its first iteration)."""
        if self.expected is None or self.counting:
            return []
        return [i for i, (c, e) in enumerate(zip(self.counts, self.expected)) if 0 < e and c < e]

    def changed_message(self, indices: list[int]) -> str:
        """A parameter got fewer gradients than the static graph's first iteration gave it: the reduction cannot
        finish (torch's error at the next forward)."""
        detail = "; ".join(f"{self.names[i]!r} got {self.counts[i]} gradient(s) where the first iteration gave it "
                           f"{self.expected[i]}" for i in indices)
        return unfinished_message(self.rank, indices, [self.names[i] for i in indices], static=True,
                                  detail=f" ({detail}). Pass static_graph=False (with find_unused_parameters=True "
                                         "if some parameters go unused).")

    def _changed(self, i: int) -> str:
        """A parameter got more gradients than the static graph's first iteration gave it (torch raises in the
        backward, with these words)."""
        was = "unused" if self.expected[i] == 0 else "used fewer times"
        return (f"DistributedDataParallel (rank {self.rank}): Your training graph has changed in this iteration, "
                f"e.g., one parameter is {was} in first iteration, but then got used in the second iteration. this "
                f"is not compatible with static_graph set to True. (static_graph=True: parameter {self.names[i]!r} "
                f"got {self.counts[i]} gradient(s) where the first iteration gave it {self.expected[i]}. A parameter "
                "unused in the first iteration must stay unused, and a used one must be used the same number of "
                "times; pass static_graph=False, with find_unused_parameters=True if some parameters go unused.)")
