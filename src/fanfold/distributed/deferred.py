"""One-bucket backward: the gradient hooks only note which parameter is done; readiness is settled at its end.

Used by the reducer (``reducer.py``), in ``readiness, deferred <- reducer``; no collectives here. With a single
bucket nothing can be reduced before the last gradient is in, so following readiness parameter by parameter buys no
overlap, only a Python call's worth of bookkeeping per parameter (hundreds of them on a model of many small
layers). When a synchronised backward has one bucket and none of the features that act in the middle of backward
(a static graph, join's announcement, sparse or delayed parameters, ZeRO stage 2, the backward of a create_graph
backward), each parameter's hook appends its index to a list and returns. At the end of backward:

* every parameter got exactly one gradient, dense and not itself differentiable (the ordinary step): readiness and
  the used-flags are set for all of them at once and the bucket is ready;
* anything else (a parameter without gradient, or ready twice, create_graph, a sparse gradient of a dense
  parameter): the recorded hooks are replayed, in their order, through the reducer's per-parameter path. Nothing
  was launched in between, so this is what the hooks would have done themselves, errors and messages included.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Deferred", "gradient_hook"]


class Deferred:
    """The state the reducer shares with its hooks (which must not hold the reducer itself): whether this backward
    defers (``on``), and the parameter indices whose hooks fired, in order."""

    __slots__ = ("on", "order")

    def __init__(self) -> None:
        self.on = False
        self.order: list[int] = []

    def arm(self, reducer: Any) -> None:
        """Before a forward whose backward synchronises (``reducer.expect_sync`` set): defer when it can."""
        self.order.clear()
        self.on = reducer.expect_sync and len(reducer.buckets) == 1 and not reducer.readiness.static and \
            reducer.on_first_ready is None and reducer.shards is None and not reducer.delayed and \
            not any(reducer.sparse)

    def settle(self, reducer: Any) -> None:
        """At the end of a deferred backward that reached some parameter: its readiness, as the hooks would have
        left it (they did nothing else)."""
        order, self.on = list(self.order), False
        self.order.clear()
        params = reducer.params
        n = len(params)
        grads = [p.grad for p in params] if len(order) == n else []
        if not grads or len(set(order)) != n or \
                any(g is None or g.requires_grad or g.is_sparse for g in grads):
            for i in order:  # the per-parameter path, exactly as the hooks would have taken it
                reducer._on_ready(i, params[i])
            return
        reducer._touched = True
        reducer.begin_backward()  # queued already; no announcement to make (no join)
        reducer._used = [True] * n
        r = reducer.readiness
        r.ready, r.counts, r.order = [True] * n, [1] * n, order
        if reducer._direct:
            reducer._left[0] = 0  # the bucket's tensors are the gradients themselves: nothing to copy here
            reducer._known_grads = grads  # read once: the launch takes them from here
            try:
                reducer._launch_ready()
            finally:
                reducer._known_grads = None
        else:
            for i in order:
                reducer._take(i, params[i])


def gradient_hook(ref: weakref.ref, deferred: Deferred, i: int | None) -> Callable[[torch.Tensor], None]:
    """Parameter ``i``'s post-accumulate-grad hook (None: a delayed parameter's). A weak reference to the reducer:
    the parameters must not keep a discarded reducer (and its hooks) alive."""

    def hook(param: torch.Tensor) -> None:
        if deferred.on:
            order = deferred.order
            order.append(i)
            if len(order) > 1:
                return
            reducer = ref()
            if reducer is not None:
                reducer.backward_started()  # the end of backward must run, whatever reached the outputs
            return
        reducer = ref()
        if reducer is not None:
            reducer._on_ready(i, param)

    return hook
