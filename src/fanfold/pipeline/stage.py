"""One stage's share of a pass (:class:`StageRun`), on a thread or a process: forward and backward steps,
activation checkpointing, in training the deferred weight gradients of its ``nn.Linear`` layers, and its random
numbers: each (micro-batch, stage) cell draws from a generator seeded from (the pass's seed, stage, micro-batch), so a
recomputation draws its forward's masks. Cells on a shared generator take a lock per pass."""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._core.tree import flatten, unflatten
from .batchnorm import DeferredNorms
from .channel import Channel
from .schedule import Step
from .skip import SkipPlan, SkipRoute, routed

__all__ = ["StageRun", "StepTime", "CHECKPOINT_MODES", "WeightGradAccumulator", "tensor_leaves", "map_tensors",
           "buffers_kept", "StageRandom", "draws_random_numbers", "pass_seed", "stage_randoms"]

CHECKPOINT_MODES = ("never", "except_last", "always")


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of an activation in ``_core.tree``'s order: the gradients sent back for it follow that order."""
    return [x for _, x in flatten(obj)[0] if isinstance(x, torch.Tensor)]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    leaves, spec = flatten(obj)
    return unflatten(spec, [fn(x) if isinstance(x, torch.Tensor) else x for _, x in leaves])


# ---- weight gradients of nn.Linear layers after the input gradients -------------------------------------------------
def _eligible(m: nn.Module) -> bool:
    if type(m) is not nn.Linear:
        return False
    w, b = m.weight, m.bias
    hooked = any(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
                 for p in (w, b))  # a hook expects AccumulateGrad to run
    return w.is_floating_point() and w.is_contiguous() and (b is None or b.dtype == w.dtype) and not hooked


@dataclass
class _Rows:  # a layer's output-gradient and input rows waiting for their product
    weight: nn.Parameter
    bias: nn.Parameter | None
    grads: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward hands the parameter gradients' rows to ``sink``, not autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None,
                sink: WeightGradAccumulator) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.sink = (weight, bias), sink  # the parameters themselves: their .grad is what gets written
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.sink.add(*ctx.params, grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1]))
        return grad_x, None, None, None


class WeightGradAccumulator:
    """One stage's pending weight-gradient rows: an eligible layer's backward computes only its input gradient and
    keeps the rows; ``step()``, once the stage has sent its input gradients upstream, adds them into ``.grad``."""

    def __init__(self) -> None:
        self._pending: dict[int, _Rows] = {}

    @contextlib.contextmanager
    def linears(self, module: nn.Module) -> Iterator[None]:
        """Inside, the eligible ``nn.Linear`` layers of ``module`` send their parameter gradients here."""
        patched = [m for m in module.modules() if _eligible(m) and "forward" not in vars(m)]
        for m in patched:
            m.forward = functools.partial(self._forward, m, m.forward)
        try:
            yield
        finally:
            for m in patched:
                del m.forward

    def _forward(self, m: nn.Linear, original: Any, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.dtype == m.weight.dtype and x.dim() >= 1
                and not torch.is_autocast_enabled(x.device.type)):
            return original(x)
        return _DeferredLinear.apply(x, m.weight, m.bias, self)

    def add(self, weight: nn.Parameter, bias: nn.Parameter | None, grad: torch.Tensor, x: torch.Tensor) -> None:
        pending = self._pending.setdefault(id(weight), _Rows(weight, bias))
        pending.grads.append(grad)
        pending.inputs.append(x)

    def step(self) -> None:
        while self._pending:
            self._apply(self._pending.popitem()[1])

    @staticmethod
    @torch.no_grad()
    def _apply(rows: _Rows) -> None:
        g = rows.grads[0] if len(rows.grads) == 1 else torch.cat(rows.grads)
        x = rows.inputs[0] if len(rows.inputs) == 1 else torch.cat(rows.inputs)
        w, b = rows.weight, rows.bias
        if w.requires_grad:
            if w.grad is not None and w.grad.is_contiguous() and w.grad.dtype == g.dtype:
                w.grad.addmm_(g.t(), x)  # the product accumulates where it is written: no temporary
            else:
                w.grad = g.t().mm(x) if w.grad is None else w.grad.add_(g.t().mm(x))
        if b is not None and b.requires_grad:
            b.grad = g.sum(0) if b.grad is None else b.grad.add_(g.sum(0))


# ---- random numbers per cell -----------------------------------------------------------------------------------------
_MASK = (1 << 64) - 1
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def draws_random_numbers(module: nn.Module) -> bool:
    """True if ``module`` holds a layer known to draw random numbers in its current mode (dropout in training)."""
    return any(m.training and ((isinstance(m, _RANDOM) and m.p > 0) or isinstance(m, nn.RReLU) or
                               (isinstance(m, nn.MultiheadAttention) and m.dropout > 0))
               for m in module.modules())


def pass_seed() -> int:
    # one draw from the caller's CPU generator, so that torch.manual_seed fixes a pass's masks
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
            seeded = torch.Generator(self.device).manual_seed(cell_seed(self.seed, self.stage, microbatch)).get_state()
            _set_state(self.device, seeded)
            try:
                yield
                self.drew = self.drew or not torch.equal(_get_state(self.device), seeded)
            finally:
                # the caller's generator continues where it was, whatever the cells drew
                _set_state(self.device, saved)


def stage_randoms(seed: int, devices: Sequence[torch.device], may_draw: Sequence[bool]) -> list[StageRandom | None]:
    """Each stage's ``StageRandom`` for a pass (None where ``may_draw`` is False: left alone); the stages that draw
    on one device share a lock."""
    drawing = [d for d, m in zip(devices, may_draw) if m]
    locks = {d: threading.RLock() for d in set(drawing) if drawing.count(d) > 1}
    return [StageRandom(seed, s, d, locks.get(d)) if m else None
            for s, (d, m) in enumerate(zip(devices, may_draw))]


@dataclass(frozen=True)
class StepTime:
    """When a step ran (``time.perf_counter()`` seconds), from the arrival of its inputs to its end."""

    stage: int
    microbatch: int
    phase: str
    start: float
    end: float


def _fresh(x: Any) -> Any:
    # in-place ops on a leaf that requires grad are refused, and on a checkpoint's saved input they would corrupt the
    # recomputation: such tensors are copied
    return map_tensors(x, lambda t: t.clone() if t.requires_grad else t)


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    # put back through .data, which keeps the buffer's version: another micro-batch's graph may have saved it
    # (BatchNorm's running statistics), and its backward would refuse a modified one
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for b, copy in saved:
            b.data.copy_(copy)


@dataclass
class StageRun:
    """Stage ``index`` of ``stages`` (``module`` on ``device``) during one pass of ``microbatches`` micro-batches.
    ``inputs`` (first stage) are its micro-batches; ``targets``, ``loss_fn``, ``weights`` (last stage, training) make
    the loss. ``train=False``: the connected mode, the last stage keeps ``outputs``. ``random``: None leaves the
    generator alone. ``norms``: the deferred BatchNorm layers (None: BatchNorm as it is). ``skips``: which stages
    stash and pop each skip connection."""

    index: int
    stages: int
    module: nn.Module
    device: torch.device
    checkpoint: str
    channel: Channel
    microbatches: int
    train: bool
    inputs: list | None = None
    targets: list | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    weights: list[float] | None = None
    random: StageRandom | None = None
    norms: DeferredNorms | None = None
    skips: SkipPlan = field(default_factory=SkipPlan)
    outputs: dict[int, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    timeline: list[StepTime] = field(default_factory=list)
    _leaves: dict[int, list] = field(default_factory=dict)
    _skip_leaves: dict[int, dict[int, dict[str, torch.Tensor | None]]] = field(default_factory=dict)
    _stashed: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    _started: float | None = None
    _weights: WeightGradAccumulator = field(default_factory=WeightGradAccumulator)

    def run(self, step: Step) -> None:
        self._started = None
        self.channel.check(self.index)  # another stage failed: no further micro-batch is scheduled here
        norms = self.norms.deferred(self.module) if self.norms is not None else contextlib.nullcontext()
        # detached training: each stage owns its graph and .grad (the connected mode leaves backward to autograd)
        with self._weights.linears(self.module) if self.train else contextlib.nullcontext(), norms:
            if step.phase == "F":
                self.forward(step.microbatch)
            else:
                self.backward(step.microbatch)
                # after the input gradients went upstream: the previous stage does not wait for these products
                self._weights.step()
        end = time.perf_counter()
        self.timeline.append(StepTime(step.stage, step.microbatch, step.phase, self._started or end, end))

    def _received(self) -> None:
        # a step's time starts when its inputs are here: waiting for them is the bubble, not work
        self._started = time.perf_counter()

    def _call(self, x: Any, m: int, own: bool, received: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The stage on ``x`` and what its ``Stash`` layers stashed; ``own``: ``x`` holds this stage's own leaves,
        which it must not modify in place; ``received``: the skips other stages stashed for this micro-batch."""
        module, random, mode, norms = self.module, self.random, self.checkpoint, self.norms
        first = SkipRoute(dict(received), recomputing=False)
        cell = (lambda: random.cell(m)) if random is not None else contextlib.nullcontext
        paused = (lambda: norms.paused(module)) if norms is not None else contextlib.nullcontext
        if torch.is_grad_enabled() and (mode == "always" or (mode == "except_last" and m < self.microbatches - 1)):

            @contextlib.contextmanager
            def recomputing() -> Iterator[None]:
                with buffers_kept(module), paused(), cell(), routed(module, SkipRoute(dict(received), True)):
                    yield

            # the copy inside the checkpointed function: a first layer working in place must not modify the saved
            # input. Not torch's saved generator state: it would be set outside the cell's lock
            with cell(), routed(module, first):
                out = checkpoint(lambda x: module(_fresh(x)), x, use_reentrant=False, preserve_rng_state=False,
                                 context_fn=lambda: (contextlib.nullcontext(), recomputing()))
            return out, first.stashed
        with cell(), routed(module, first):
            return module(_fresh(x) if own else x), first.stashed

    def _as_leaves(self, x: Any) -> tuple[Any, list[torch.Tensor | None]]:
        """``x`` on this stage's device, its floating tensors fresh leaves that require grad (None for others)."""
        device, leaves = self.device, []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            own = t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else None
            leaves.append(own)
            return t if own is None else own

        return map_tensors(x, leaf), leaves

    def _receive_leaves(self, x: Any, m: int) -> Any:
        x, self._leaves[m] = self._as_leaves(x)
        return x

    def _receive_skips(self, m: int) -> dict[str, Any]:
        """The skips stashed for this stage's micro-batch ``m`` by earlier stages, on this stage's device."""
        received: dict[str, Any] = {}
        for src, names in self.skips.receives(self.index).items():
            got = self.channel.recv(self.index, src, "skip", m)
            for name in names:
                if name not in got:
                    raise RuntimeError(f"Pop({name!r}) on stage {self.index}: stage {src}'s Stash({name!r}) stashed "
                                       f"nothing in micro-batch {m}")
                if self.train:
                    received[name], leaves = self._as_leaves(got[name])
                    self._skip_leaves.setdefault(m, {}).setdefault(src, {})[name] = received[name], leaves
                else:
                    received[name] = map_tensors(got[name], lambda t: t.to(self.device))
        return received

    def _send_skips(self, m: int, stashed: dict[str, Any]) -> None:
        for dst, names in self.skips.sends(self.index).items():
            mine = {n: stashed[n] for n in names if n in stashed}
            if self.train:
                self._stashed.setdefault(m, {})[dst] = mine
            self.channel.send(self.index, dst, "skip", m,
                              {n: map_tensors(v, torch.Tensor.detach) for n, v in mine.items()} if self.train else mine)

    def forward(self, m: int) -> None:
        s, device = self.index, self.device
        first, last = s == 0, s == self.stages - 1
        x = self.inputs[m] if first else self.channel.recv(s, s - 1, "activation", m)
        received = self._receive_skips(m)
        self._received()
        if self.train:
            out, stashed = self._call(x if first else self._receive_leaves(x, m), m, not first, received)
        else:  # connected: one graph spans the stages
            out, stashed = self._call(x if first else map_tensors(x, lambda t: t.to(device)), m, False, received)
        self._send_skips(m, stashed)
        if last and self.train:
            loss = self.loss_fn(out, self.targets[m]) if self.targets is not None else self.loss_fn(out)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a 0-dim tensor, got {type(loss).__name__} "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else loss!r}")
            out = loss * self.weights[m]
            self.loss = out.detach() if self.loss is None else self.loss + out.detach()
        if last or self.train:
            self.outputs[m] = out
        if not last:
            self.channel.send(s, s + 1, "activation", m, map_tensors(out, torch.Tensor.detach) if self.train else out)

    def backward(self, m: int) -> None:
        s = self.index
        out = self.outputs.pop(m)
        pairs = []
        if s < self.stages - 1:
            grads = self.channel.recv(s, s + 1, "grad", m)
            pairs = list(zip(tensor_leaves(out), grads))
        for dst, stashed in self._stashed.pop(m, {}).items():  # the skips' gradients, from the stages that popped
            grads = self.channel.recv(s, dst, "skipgrad", m)
            for name, value in stashed.items():
                pairs += zip(tensor_leaves(value), grads[name])
        self._received()
        pairs = [(t, g.to(t.device)) for t, g in pairs if g is not None and t.requires_grad]
        if s == self.stages - 1:
            torch.autograd.backward([out, *(t for t, _ in pairs)], [None, *(g for _, g in pairs)])
        elif pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        leaves = self._leaves.pop(m, [])
        if s > 0:
            self.channel.send(s, s - 1, "grad", m, [None if t is None else t.grad for t in leaves])
        for src, popped in self._skip_leaves.pop(m, {}).items():
            grads = {name: [None if t is None else t.grad for t in leaves] for name, (_, leaves) in popped.items()}
            self.channel.send(s, src, "skipgrad", m, grads)
