"""Which torch optimizers a ``ZeroRedundancyOptimizer`` may step in slices, and which in cache-sized pieces.

Stepping a slice of a parameter gives the same elements as stepping the whole parameter only if each element's
update reads that element's own gradient and state. Every ``torch.optim`` class does, except those named in
``NOT_ELEMENTWISE`` (refused). A user's own class is taken at its word, as torch's ZeroRedundancyOptimizer does.

Cutting the slices further, into pieces of at most ``layout.PIECE_BYTES`` each in a parameter group of its own, lets
each of the inner optimizer's passes over the state (Adam makes about six) run over one piece while it is in cache,
rather than streaming every pass from main memory (docs/zero.md has the figures). That needs more than
elementwise: every per-parameter scalar of the state (``step``, ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``)
must advance the same way for every piece of a parameter, and nothing may be shared across a parameter group. We
have read the update of each class in ``PIECEWISE`` and it is so; they are matched by exact type, so a subclass
(which may override ``step``) steps whole, as does a user's own class. ``fused=True`` also steps whole: the fused
kernel reads and writes each element once already, and pieces only add overhead. Part of ``fanfold.optim``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["NOT_ELEMENTWISE", "PIECEWISE", "check_elementwise", "steps_in_pieces"]

# torch optimizers whose update of one element depends on other elements of the same parameter (matrix
# factorisations, line searches, sparse rows): a slice of a parameter would not step as the whole parameter does.
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
# torch optimizers whose update is elementwise with per-parameter scalars that every piece advances alike.
PIECEWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "ASGD")


def check_elementwise(optimizer_class: type) -> None:
    """ValueError for the torch optimizers that cannot step slices of parameters."""
    bad = [n for n in NOT_ELEMENTWISE if getattr(torch.optim, n, None) is optimizer_class]
    if bad:
        raise ValueError(f"ZeroRedundancyOptimizer: {bad[0]} does not update each element independently, so "
                         f"it cannot step slices of parameters")


def steps_in_pieces(optimizer_class: type, options: Mapping[str, Any]) -> bool:
    """Whether ``optimizer_class`` steps a parameter group with these ``options`` (the user's defaults and the
    group's own) in cache-sized pieces: one of torch's own ``PIECEWISE`` classes exactly, not fused."""
    known = any(getattr(torch.optim, n, None) is optimizer_class for n in PIECEWISE)
    return known and not options.get("fused")
