"""``Pipeline``: a sequential model cut into stages on devices of one process, each stage on a worker thread in the
caller's thread-local torch state; and the data parallelism over pipelines that ``DistributedPipeline`` shares.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.devices import DeviceLike, normalize_device
from ..collectives.stall import group_transport
from ..collectives.transport import split_into
from ..parallel.parallel_apply import WorkerPool, _caller_state, in_caller_state, reraise
from .channel import Channel, StageAborted, ThreadChannel
from .partition import batch_size, chunk_sizes, join, layers_of, loss_weights, resolve_balance, split, stage_modules
from .rng import draws_random_numbers, pass_seed, stage_randoms
from .schedule import ScheduleFn, Step, clocked, resolve, stage_orders
from .stage import CHECKPOINT_MODES, StageRun, StepTime

__all__ = ["Pipeline", "check_chunks", "check_checkpoint", "broadcast_state", "average_gradients"]


# ---- driving the stages: serially on the caller's thread, or each stage on its own worker -------------------------
def _run_serial(runs: Sequence[StageRun], orders: list[list[Step]], state: dict) -> None:
    for cycle in clocked(orders):
        for step in cycle:
            run = runs[step.stage]
            try:
                with in_caller_state(state, run.device):
                    run.run(step)
            except BaseException as exc:
                reraise(f"in pipeline stage {step.stage} on {run.device}", exc)


def _work(run: StageRun, order: list[Step], channel: Channel, state: dict) -> None:
    try:
        with in_caller_state(state, run.device):
            for step in order:
                run.run(step)
    except BaseException:
        channel.abort(run.index)
        raise


def _run_threads(runs: Sequence[StageRun], orders: list[list[Step]], channel: Channel, state: dict,
                 pool: WorkerPool) -> None:
    """Stage s's steps on worker s, all at once. Each follows only its own order (checked by ``stage_orders``: it
    cannot deadlock); an error aborts the channel and is raised here once every worker has returned."""
    results = pool.run([
        # default arguments bind this stage's values (a closure would see the loop's last ones)
        lambda run=run, order=order: _work(run, order, channel, state)
        for run, order in zip(runs, orders)
    ])
    failed = [(s, value) for s, (ok, value) in enumerate(results) if not ok]
    if failed:
        # the stage that failed first is the one whose error is not "stopped because another stage failed"
        s, exc = next(((s, e) for s, e in failed if not isinstance(e, StageAborted)), failed[0])
        reraise(f"in pipeline stage {s} on {runs[s].device}", exc)


# ---- data parallelism over pipelines ------------------------------------------------------------------------------
_BUCKET_BYTES = 32 * 1024 * 1024


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one (dtype, device), at most ~32 MiB per bucket: a big model is not copied whole."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        chunks = groups.setdefault((t.dtype, t.device), [[]])
        if chunks[-1] and sum(x.numel() * x.element_size() for x in chunks[-1]) >= _BUCKET_BYTES:
            chunks.append([])
        chunks[-1].append(t)
    return [c for chunks in groups.values() for c in chunks]


@torch.no_grad()
def broadcast_state(tensors: Iterable[torch.Tensor], group: Any) -> None:
    """Copy ``tensors`` (parameters, buffers) from the group's rank 0 to every rank of ``group``, in place."""
    transport = group_transport(group, "Pipeline data parallelism")
    for t in tensors:
        flat = t.detach().reshape(-1)  # 1-d (a 0-d buffer too); a copy where t is not contiguous, hence the copy back
        transport.broadcast(flat, 0)
        t.copy_(flat.view_as(t))


@torch.no_grad()
def average_gradients(parameters: Iterable[nn.Parameter], group: Any) -> None:
    """Replace each parameter's ``.grad`` by its mean over ``group``. A missing ``.grad`` counts as zeros, so every
    rank issues the same all-reduces whatever its batch touched."""
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    transport = group_transport(group, "Pipeline data parallelism")
    for bucket in _buckets([p.grad for p in params]):
        flat = torch.cat([g.reshape(-1) for g in bucket])  # any layout: a channels_last gradient keeps its own
        transport.all_reduce(flat, divisor=transport.world_size).wait()
        split_into(flat, bucket)


def check_chunks(chunks: Any) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1 (micro-batches per batch), got {chunks!r}")
    return chunks


def check_checkpoint(mode: Any) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {list(CHECKPOINT_MODES)}, got {mode!r}")
    return mode


class Pipeline(nn.Module):
    """``module`` (an ``nn.Sequential`` or a list of modules) cut into stages: stage s holds ``balance[s]``
    consecutive layers on ``devices[s]``; each batch runs as ``chunks`` micro-batches.

    ``balance``: a list of layer counts, ``"auto"`` (even parameter counts) or ``"profile"`` (even measured time on
    ``sample_input``). ``devices``: one per stage, repeats allowed (``["cpu", "cpu"]``); None puts every stage where
    the model is (then ``balance`` must be a list). ``checkpoint``: ``"never"``, ``"except_last"`` (all micro-batches
    but the last recompute their activations in backward) or ``"always"``. ``data_parallel_group``: a process group
    over which ``train_step`` averages gradients (each rank runs a pipeline on its share of the batch).
    The layers are moved to their devices in place and registered under their own names, so ``state_dict()`` has
    the keys of the sequential model.
    """

    def __init__(self, module: nn.Sequential | Sequence[nn.Module], balance: Sequence[int] | str = "auto",
                 devices: Sequence[DeviceLike] | None = None, chunks: int = 1, checkpoint: str = "never", *,
                 sample_input: Any = None, threads_per_stage: int = 1, data_parallel_group: Any = None) -> None:
        super().__init__()
        layers = layers_of(module)
        if devices is None:
            if isinstance(balance, str):
                raise ValueError(f'balance={balance!r} needs devices (one per stage) to know the number of stages; '
                                 'or give balance as a list of layer counts')
            where = (t.device for _, layer in layers for t in itertools.chain(layer.parameters(), layer.buffers()))
            devices = [next(where, "cpu")] * len(balance)
        if isinstance(devices, (str, int, torch.device)) or len(devices) == 0:
            raise ValueError(f"devices must be a non-empty list with one device per stage, got {devices!r}")
        self.devices = [normalize_device(d) for d in devices]
        self.balance = resolve_balance(balance, layers, len(self.devices), sample_input)
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_checkpoint(checkpoint)
        if isinstance(threads_per_stage, bool) or not isinstance(threads_per_stage, int) or threads_per_stage < 1:
            raise ValueError(f"threads_per_stage must be an int >= 1, got {threads_per_stage!r}")
        self.threads_per_stage = threads_per_stage
        for name, layer in layers:
            self.add_module(name, layer)
        self._stages = stage_modules(layers, self.balance)  # a plain list: the layers are registered above
        for stage, device in zip(self._stages, self.devices):
            stage.to(device)
        self._pool: WorkerPool | None = None
        # (stage, its modules' training flags) seen drawing no random number in a controlled pass (rng.py)
        self._quiet: set[tuple[int, tuple[bool, ...]]] = set()
        if isinstance(data_parallel_group, str) and data_parallel_group != "world":
            raise ValueError(f'data_parallel_group must be a process group, "world" or None, '
                             f'got {data_parallel_group!r}')
        self.data_parallel_group = dist.group.WORLD if data_parallel_group == "world" else data_parallel_group
        if self.data_parallel_group is not None:
            broadcast_state(itertools.chain(self.parameters(), self.buffers()), self.data_parallel_group)
        self.last_timeline: list[StepTime] = []

    @property
    def module(self) -> nn.Sequential:
        """The layers as one ``nn.Sequential`` (the same layer objects, on their stages' devices)."""
        return nn.Sequential(OrderedDict(self.named_children()))

    @property
    def stages(self) -> list[nn.Sequential]:
        """Stage s's layers as an ``nn.Sequential``, one per stage."""
        return list(self._stages)

    # ---- the four verbs -------------------------------------------------------------------------------------
    def split(self, input: Any) -> list[Any]:
        """``input`` as micro-batches on the first stage's device (fewer than ``chunks`` for a small batch)."""
        return split(input, chunk_sizes(batch_size(input, "input"), self.chunks), self.devices[0])

    def _runs(self, channel: ThreadChannel, microbatches: list, train: bool, seed: int, grad: bool,
              **last: Any) -> list[StageRun]:
        n = len(self._stages)
        controlled = (grad and self.checkpoint != "never") or any(map(draws_random_numbers, self._stages))
        keys = [self._quiet_key(s) for s in range(n)]
        # a stage that drew nothing in an earlier controlled pass in the same modes is left alone: with no lock it
        # overlaps the others (known random layers always draw)
        may_draw = [keys[s] not in self._quiet or draws_random_numbers(stage) for s, stage in enumerate(self._stages)]
        randoms = stage_randoms(seed, self.devices, 0, controlled, may_draw)
        return [StageRun(s, n, stage, dev, self.checkpoint, channel, len(microbatches), train,
                         inputs=microbatches if s == 0 else None, random=random, **(last if s == n - 1 else {}))
                for s, (stage, dev, random) in enumerate(zip(self._stages, self.devices, randoms))]

    def _quiet_key(self, s: int) -> tuple[int, tuple[bool, ...]]:
        return s, tuple(m.training for m in self._stages[s].modules())

    def _observe(self, runs: list[StageRun]) -> None:
        for s, run in enumerate(runs):
            if run.random is not None:
                (self._quiet.discard if run.random.drew else self._quiet.add)(self._quiet_key(s))

    def _execute(self, runs: list[StageRun], orders: list[list[Step]], channel: ThreadChannel, state: dict) -> None:
        if len(runs) > 1 and runs[0].microbatches > 1:
            if self._pool is None:
                self._pool = WorkerPool(threads_per_worker=self.threads_per_stage)
            _run_threads(runs, orders, channel, state, self._pool)
        else:  # nothing could overlap: no thread hand-offs
            _run_serial(runs, orders, state)
        self._observe(runs)
        self.last_timeline = sorted(itertools.chain.from_iterable(r.timeline for r in runs), key=lambda t: t.start)

    def join(self, outputs: list[Any]) -> Any:
        """The micro-batches' outputs concatenated along dim 0 on the last stage's device."""
        return join(outputs, self.devices[-1])

    # ---- passes ---------------------------------------------------------------------------------------------
    def forward(self, input: Any) -> Any:
        """The sequential model's output for ``input`` (a tensor or a tuple of them), on the last stage's device."""
        microbatches = self.split(input)
        channel = ThreadChannel(len(self._stages))
        state = _caller_state(self.devices)
        runs = self._runs(channel, microbatches, train=False, seed=pass_seed(), grad=state["grad"])
        orders = [[Step(s, m, "F") for m in range(len(microbatches))] for s in range(len(runs))]
        self._execute(runs, orders, channel, state)
        return self.join([runs[-1].outputs[m] for m in range(len(microbatches))])

    def train_step(self, input: Any, target: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None, *,
                   schedule: str | ScheduleFn = "1f1b", reduction: str = "mean") -> torch.Tensor:
        """Forward and backward of ``loss_fn(model(input), target)`` as a pipeline schedule; returns the loss.

        Gradients accumulate into ``.grad`` as ``loss.backward()`` would (zero them first as usual) and equal the
        sequential model's. ``loss_fn(output, target)`` (``loss_fn(output)`` when ``target`` is None) runs once per
        micro-batch on the last stage; ``reduction`` says how it reduces over the batch: ``"mean"`` (micro-batch m
        weighs rows_m / batch) or ``"sum"``. ``schedule``: ``"1f1b"``, ``"gpipe"`` or a function
        ``(stages, microbatches) -> clock cycles of Step``. Grad mode is on in the stages whatever the caller's.
        With ``data_parallel_group``, the gradients are then averaged over the group; the returned loss is this
        rank's.
        """
        if not callable(loss_fn):
            raise TypeError(f"train_step needs loss_fn, a function (output, target) -> 0-dim loss, got {loss_fn!r}")
        rows = batch_size(input, "input")
        if target is not None and batch_size(target, "target") != rows:
            raise ValueError(f"target has {batch_size(target, 'target')} rows along dim 0 but input has {rows}")
        sizes = chunk_sizes(rows, self.chunks)
        microbatches = split(input, sizes, self.devices[0])
        targets = split(target, sizes, self.devices[-1]) if target is not None else None
        channel = ThreadChannel(len(self._stages))
        runs = self._runs(channel, microbatches, train=True, seed=pass_seed(), grad=True, targets=targets,
                          loss_fn=loss_fn, weights=loss_weights(sizes, reduction))
        orders = stage_orders(resolve(schedule)(len(runs), len(sizes)), len(runs), len(sizes))
        self._execute(runs, orders, channel, _caller_state(self.devices, grad=True))
        if self.data_parallel_group is not None:
            average_gradients(self.parameters(), self.data_parallel_group)
        return runs[-1].loss

    # ---- placement is fixed -----------------------------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> Pipeline:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            raise RuntimeError(f"Pipeline.to({device}): the stages stay on their devices {self.devices}; build a "
                               "new Pipeline to place them elsewhere (a dtype alone may be changed)")
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Pipeline:
        raise RuntimeError(f"Pipeline.cuda(): the stages stay on their devices {self.devices}")

    def cpu(self) -> Pipeline:
        raise RuntimeError(f"Pipeline.cpu(): the stages stay on their devices {self.devices}")

    def close(self) -> None:
        """Stop the worker threads now (they also stop when the Pipeline is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def extra_repr(self) -> str:
        return f"balance={self.balance}, devices={[str(d) for d in self.devices]}, chunks={self.chunks}, " \
               f"checkpoint={self.checkpoint!r}"
