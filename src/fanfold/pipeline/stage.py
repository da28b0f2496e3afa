"""One stage's share of a pass: its forward and backward steps (:class:`StageRun`), whichever thread or process runs
them; ``pipe`` and ``distributed`` both drive a StageRun per stage through its order of steps.

Connected mode (``Pipeline.forward``): one autograd graph spans the stages. Detached mode (training steps): each stage
owns its graph, receives activations as fresh leaves and sends their gradients back. Activation checkpointing and
its buffer and random-number replay are here too; design notes: docs/pipeline.md.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .accumulate import WeightGradAccumulator
from .activations import map_tensors, tensor_leaves
from .channel import Channel
from .rng import StageRandom
from .schedule import Step

__all__ = ["StageSpec", "StageRun", "StepTime", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("never", "except_last", "always")


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``stages``: its layers, their device and its checkpointing mode."""

    index: int
    stages: int
    module: nn.Module
    device: torch.device
    checkpoint: str = "never"


@dataclass(frozen=True)
class StepTime:
    """When a step ran (``time.perf_counter()`` seconds), from the arrival of its inputs to its end: the time a
    stage worked. For timelines and the measured bubble."""

    stage: int
    microbatch: int
    phase: str
    start: float
    end: float


def _fresh(x: Any) -> Any:
    """``x`` with its tensors that require grad copied: in-place ops on a leaf that requires grad are refused, and
    on a checkpoint's saved input they would corrupt the recomputation."""
    return map_tensors(x, lambda t: t.clone() if t.requires_grad else t)


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    # Put back through .data, which does not bump the buffer's version: another micro-batch's graph may have saved
    # the buffer (BatchNorm saves its running statistics, in training mode too), and its backward would then refuse
    # it as modified in place. Safe: BatchNorm's backward reads them only in eval mode, where they do not change.
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for b, copy in saved:
            b.data.copy_(copy)


@dataclass
class StageRun:
    """Stage ``spec``'s state during one pass of ``microbatches`` micro-batches.

    ``inputs`` (first stage) are its micro-batches; ``targets``, ``loss_fn`` and ``weights`` (last stage, training)
    make the loss. ``train=False`` is the connected mode: the last stage keeps its outputs in ``outputs``.
    ``random``: the stage's generator state per micro-batch in this pass (None: the pass leaves randomness alone).
    """

    spec: StageSpec
    channel: Channel
    microbatches: int
    train: bool
    inputs: list | None = None
    targets: list | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    weights: list[float] | None = None
    random: StageRandom | None = None
    outputs: dict[int, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    timeline: list[StepTime] = field(default_factory=list)
    _leaves: dict[int, list] = field(default_factory=dict)
    _started: float | None = None
    _weights: WeightGradAccumulator = field(default_factory=WeightGradAccumulator)

    @property
    def first(self) -> bool:
        return self.spec.index == 0

    @property
    def last(self) -> bool:
        return self.spec.index == self.spec.stages - 1

    def run(self, step: Step) -> None:
        self._started = None
        # detached training: each stage owns its graph and its .grad, so its linear layers may accumulate their
        # weight gradients in place (accumulate.py); the connected mode leaves backward to the user's autograd call
        with self._weights.linears(self.spec.module) if self.train else contextlib.nullcontext():
            if step.phase == "F":
                self.forward(step.microbatch)
            else:
                self.backward(step.microbatch)
                # the weight gradients after the input gradients went upstream: the previous stage is not kept
                # waiting for products that only this stage needs
                self._weights.step()
        end = time.perf_counter()
        self.timeline.append(StepTime(step.stage, step.microbatch, step.phase, self._started or end, end))

    def _received(self) -> None:
        # a step's time starts when its inputs are here: waiting for them is the bubble, not work
        self._started = time.perf_counter()

    def _call(self, x: Any, m: int, own: bool) -> Any:
        """The stage on ``x``; ``own``: ``x`` holds this stage's own leaves, which it must not modify in place."""
        mode = self.spec.checkpoint
        module = self.spec.module
        random = self.random
        cell = (lambda: random.cell(m)) if random is not None else contextlib.nullcontext
        if torch.is_grad_enabled() and (mode == "always" or (mode == "except_last" and m < self.microbatches - 1)):

            @contextlib.contextmanager
            def recomputing() -> Iterator[None]:
                with _buffers_kept(module), cell():
                    yield

            # the copy is made inside the checkpointed function: checkpoint saves its inputs for the recomputation,
            # and a first layer working in place (ReLU(inplace=True)) must not modify what was saved. torch's own
            # saved generator state is never used: the cell replays the draws, and a stage without a cell draws
            # nothing (rng.py), while torch would set the shared generator outside any lock, under another
            # stage's forward
            with cell():
                return checkpoint(lambda x: module(_fresh(x)), x, use_reentrant=False, preserve_rng_state=False,
                                  context_fn=lambda: (contextlib.nullcontext(), recomputing()))
        with cell():
            return module(_fresh(x) if own else x)

    def _receive_leaves(self, x: Any, m: int) -> Any:
        device, leaves = self.spec.device, []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            if not t.is_floating_point() and not t.is_complex():
                leaves.append(None)
                return t
            own = t.detach().requires_grad_()
            leaves.append(own)
            return own

        x = map_tensors(x, leaf)
        self._leaves[m] = leaves
        return x

    def forward(self, m: int) -> None:
        s, device = self.spec.index, self.spec.device
        x = self.inputs[m] if self.first else self.channel.recv(s, s - 1, "activation", m)
        self._received()
        if not self.train:
            out = self._call(x if self.first else map_tensors(x, lambda t: t.to(device)), m, own=False)
            if self.last:
                self.outputs[m] = out
            else:
                self.channel.send(s, s + 1, "activation", m, out)
            return
        out = self._call(x if self.first else self._receive_leaves(x, m), m, own=not self.first)
        if self.last:
            loss = self.loss_fn(out, self.targets[m]) if self.targets is not None else self.loss_fn(out)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a 0-dim tensor, got {type(loss).__name__} "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else loss!r}")
            weighted = loss * self.weights[m]
            self.outputs[m] = weighted
            self.loss = weighted.detach() if self.loss is None else self.loss + weighted.detach()
        else:
            self.outputs[m] = out
            self.channel.send(s, s + 1, "activation", m, map_tensors(out, torch.Tensor.detach))

    def backward(self, m: int) -> None:
        s = self.spec.index
        out = self.outputs.pop(m)
        if self.last:
            self._received()
            out.backward()
        else:
            grads = self.channel.recv(s, s + 1, "grad", m)
            self._received()
            pairs = [(t, g.to(t.device)) for t, g in zip(tensor_leaves(out), grads)
                     if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        leaves = self._leaves.pop(m, [])
        if not self.first:
            self.channel.send(s, s - 1, "grad", m, [None if t is None else t.grad for t in leaves])
