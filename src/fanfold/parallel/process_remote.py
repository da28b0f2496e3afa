"""The process engine's autograd Function, ``Remote``: every replica's outputs joined to the caller's graph, and their
backward (post each worker's output gradients, differentiate replica 0 in the caller meanwhile, sum the parameter
gradients in replica order and hand the sum to autograd, so a parameter hook runs once, on the sum).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function

from .process_slots import unpack
from .process_worker import Backward, Gradients, Graph, run_backward


@dataclass
class Step:
    """What ``_Remote`` needs: the engine (``ProcessEngine``) and its generation (its workers' start), each worker's
    step number, each replica's outputs' range, each replica's positions among the chunk inputs, replica 0's graph."""

    engine: Any
    generation: int
    steps: list[int]
    slices: list[tuple[int, int]]
    inputs: list[list[int]]
    num_chunks: int
    graph: Graph | None


class _Token:
    """Lives as long as the caller's graph node: when it goes, the workers may drop their graphs of that step."""

    def __init__(self, engine: Any, steps: list[int]) -> None:
        self.engine, self.steps = weakref.ref(engine), steps

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            for w, step in enumerate(self.steps[:len(engine.released)]):  # worker w ran step: it may drop its graph
                engine.released[w].append(step)


def _sum(local: list, replies: list[Gradients], views: list[list[torch.Tensor]]) -> list:
    """Per parameter, replica 0's gradient plus the workers', in replica order; a new tensor, or None if unused."""
    if all(g is not None and g.layout == torch.strided for g in local) and all(
            all(p is True for p in r.parameters) for r in replies):
        if not replies:
            return [g.clone() for g in local]  # autograd may hand a tensor it holds elsewhere: not ours to give away
        total = torch._foreach_add(local, views[0])
        for w in range(1, len(replies)):
            torch._foreach_add_(total, views[w])
        return total
    sums = []
    for k, g in enumerate(local):  # some replica did not use a parameter, or a gradient is sparse
        parts = [g] + [views[w][k] if r.parameters[k] is True else r.parameters[k] for w, r in enumerate(replies)]
        parts = [p for p in parts if p is not None]
        total = parts[0].clone() if len(parts) == 1 else torch.add(parts[0], parts[1]) if parts else None
        for p in parts[2:]:
            total = total + p
        sums.append(total)
    return sums


class Remote(Function):
    """``Remote.apply(step, outputs, *chunks, *params)``: see the module docstring."""

    @staticmethod
    def forward(ctx, step: Step, outputs: list, *tensors: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.step = step
        ctx.token = _Token(step.engine, step.steps)
        ctx.save_for_backward(torch.empty(0))  # so that autograd refuses a second backward without retain_graph
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        ctx.saved_tensors  # noqa: B018  (raises autograd's own error on a second backward without retain_graph)
        if torch.is_grad_enabled():
            raise RuntimeError("DataParallel(engine='process'): double backward (create_graph=True) is not "
                               "supported by the process engine; use engine='thread'")
        step, engine = ctx.step, ctx.step.engine
        if step.steps and step.generation != engine.generation:
            raise RuntimeError("DataParallel(engine='process'): the workers were stopped since this forward (close(), "
                               "a dead worker or Ctrl-C) or restarted (a structure change); run the forward again")

        def post(w: int) -> Backward:
            lo, hi = step.slices[w + 1]
            packed, grown = engine.inboxes[w].pack(list(grads[lo:hi]))
            return Backward(step.steps[w], packed, grown)

        def local() -> list:
            lo, hi = step.slices[0]
            return run_backward(step.graph, list(grads[lo:hi]))

        mine, replies = engine.exchange(len(step.steps), post, local, "backward")
        split = len(mine) - len(step.inputs[0])
        chunk_grads: list = [None] * step.num_chunks
        for pos, g in zip(step.inputs[0], mine[split:]):
            chunk_grads[pos] = g
        for w, reply in enumerate(replies):
            for pos, g in zip(step.inputs[w + 1], unpack(engine.outboxes[w], reply.inputs, copy=True)):
                chunk_grads[pos] = g
        return (None, None, *chunk_grads, *_sum(mine[:split], replies, engine.grad_views))
