"""``Pipeline``: a sequential model cut into stages on devices of one process, each stage on a worker thread in the
caller's thread-local torch state; ``DistributedPipeline``: one stage per process, N/S pipelines of S consecutive
ranks; and the data parallelism over pipelines that both share."""
from __future__ import annotations

import contextlib
import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.devices import DeviceLike, normalize_device
from .._core.job import require_initialized
from ..collectives.stall import group_transport
from ..collectives.transport import split_into
from ..distributed.reducer import MiB, assign_buckets
from ..parallel.parallel_apply import WorkerPool, _caller_state, in_caller_state, reraise
from ..parallel.scatter_gather import split_sizes
from .batchnorm import DeferredNorms, refuse_sync_batchnorm
from .channel import Channel, ProcessChannel, StageAborted, ThreadChannel
from .partition import batch_size, join, layers_of, loss_weights, resolve_balance, split, stage_modules
from .schedule import ScheduleFn, Step, resolve, stage_orders
from .skip import plan_skips
from .stage import CHECKPOINT_MODES, StageRandom, StageRun, StepTime, draws_random_numbers, pass_seed, stage_randoms

__all__ = ["Pipeline", "DistributedPipeline", "broadcast_state", "average_gradients"]


def _run_threads(runs: Sequence[StageRun], orders: list[list[Step]], channel: Channel, state: dict,
                 pool: WorkerPool) -> None:
    """Stage s's steps on worker s, each in its own order (``stage_orders`` checked it cannot deadlock); an error
    aborts the channel and is raised here once every worker has returned."""
    def work(run: StageRun, order: list[Step]) -> None:
        try:
            with in_caller_state(state, run.device):
                for step in order:
                    run.run(step)
        except BaseException:
            channel.abort(run.index)
            raise

    results = pool.run([functools.partial(work, run, order) for run, order in zip(runs, orders)])
    failed = [(s, value) for s, (ok, value) in enumerate(results) if not ok]
    if failed:
        # the stage that failed first is the one whose error is not "stopped because another stage failed"
        s, exc = next(((s, e) for s, e in failed if not isinstance(e, StageAborted)), failed[0])
        reraise(f"in pipeline stage {s} on {runs[s].device}", exc)


@contextlib.contextmanager
def _committed(norms: DeferredNorms | None) -> Iterator[None]:
    """A pass: the deferred BatchNorm statistics move once it has run every micro-batch; a failed pass leaves them
    as they were."""
    if norms is None:
        yield
        return
    norms.discard()
    try:
        yield
    except BaseException:
        norms.discard()
        raise
    norms.commit()


# ---- data parallelism over pipelines ------------------------------------------------------------------------------
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
    transport, grads = group_transport(group, "Pipeline data parallelism"), [p.grad for p in params]
    # buckets of ~32 MiB of one (dtype, device): a big model is not copied whole
    for members in assign_buckets([g.numel() * g.element_size() for g in grads], [(g.dtype, g.device) for g in grads],
                                  [32 * MiB], order=range(len(grads))):
        bucket = [grads[i] for i in members]
        flat = torch.cat([g.reshape(-1) for g in bucket])  # any layout: a channels_last gradient keeps its own
        transport.all_reduce(flat, divisor=transport.world_size).wait()
        split_into(flat, bucket)


def check_options(chunks: Any, checkpoint: Any, deferred_batch_norm: Any) -> tuple[int, str, bool]:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1 (micro-batches per batch), got {chunks!r}")
    if not isinstance(checkpoint, str) or checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {list(CHECKPOINT_MODES)}, got {checkpoint!r}")
    if not isinstance(deferred_batch_norm, bool):
        raise TypeError(f"deferred_batch_norm must be True or False, got {deferred_batch_norm!r}")
    return chunks, checkpoint, deferred_batch_norm


def pass_checkpoint(checkpoint: str, training: bool) -> str:
    # in eval mode no backward is expected: recomputation would only cost a second forward
    return checkpoint if training else "never"


def check_loss_fn(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"train_step needs loss_fn, a function (output, target) -> 0-dim loss, got {loss_fn!r}")


class Pipeline(nn.Module):
    """``module`` (an ``nn.Sequential`` or a list of modules) cut into stages: stage s holds ``balance[s]``
    consecutive layers on ``devices[s]``; each batch runs as ``chunks`` micro-batches. It behaves as the sequential
    model: ``len``, indexing (an int, a slice), iteration and ``named_children()`` are its layers'.

    ``balance``: a list of layer counts, ``"auto"`` (even parameter counts) or ``"profile"`` (even measured time on
    ``sample_input``). ``devices``: one per stage, repeats allowed (``["cpu", "cpu"]``); None puts every stage where
    the model is (then ``balance`` must be a list). ``checkpoint``: ``"never"``, ``"except_last"`` (all micro-batches
    but the last recompute their activations in backward) or ``"always"``, in training mode only.
    ``deferred_batch_norm``: BatchNorm layers move their running statistics once per mini-batch, from all its
    micro-batches (the sequential model's on the whole batch). ``data_parallel_group``: a process group
    over which ``train_step`` averages gradients (each rank runs a pipeline on its share of the batch).
    The layers are moved to their devices in place and registered under their own names, so ``state_dict()`` has
    the keys of the sequential model.
    """

    def __init__(self, module: nn.Sequential | Sequence[nn.Module], balance: Sequence[int] | str = "auto",
                 devices: Sequence[DeviceLike] | None = None, chunks: int = 1, checkpoint: str = "never",
                 deferred_batch_norm: bool = False, *, sample_input: Any = None, threads_per_stage: int = 1,
                 data_parallel_group: Any = None) -> None:
        super().__init__()
        layers = layers_of(module.module if isinstance(module, Pipeline) else module)
        refuse_sync_batchnorm(layers)
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
        self.chunks, self.checkpoint, self.deferred_batch_norm = check_options(chunks, checkpoint,
                                                                                deferred_batch_norm)
        if isinstance(threads_per_stage, bool) or not isinstance(threads_per_stage, int) or threads_per_stage < 1:
            raise ValueError(f"threads_per_stage must be an int >= 1, got {threads_per_stage!r}")
        self.threads_per_stage = threads_per_stage
        for name, layer in layers:
            self.add_module(name, layer)
        self._stages = stage_modules(layers, self.balance)  # a plain list: the layers are registered above
        for stage, device in zip(self._stages, self.devices):
            stage.to(device)
        self._norms = DeferredNorms(self._stages) if deferred_batch_norm else None
        self._skips = plan_skips(layers, self.balance)
        self._pool: WorkerPool | None = None
        # (stage, its modules' training flags) seen drawing no random number in a controlled pass
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

    def __len__(self) -> int:
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(dict(self.named_children()).values())

    def __getitem__(self, index: int | slice) -> nn.Module:
        """Layer ``index`` (negative counts from the end); a slice: those layers as an ``nn.Sequential``."""
        return self.module[index]

    def split(self, input: Any) -> list[Any]:
        """``input`` as micro-batches on the first stage's device (fewer than ``chunks`` for a small batch)."""
        return split(input, split_sizes(batch_size(input, "input"), self.chunks), self.devices[0])

    def _quiet_key(self, s: int) -> tuple[int, tuple[bool, ...]]:
        return s, tuple(m.training for m in self._stages[s].modules())

    def _pass(self, microbatches: list, state: dict, schedule: ScheduleFn | None = None, **last: Any) -> StageRun:
        """One pass on the workers, forwards only (``schedule`` None) or training; returns the last stage's run."""
        n, m, seed, channel = len(self._stages), len(microbatches), pass_seed(), ThreadChannel(len(self._stages))
        checkpoint = pass_checkpoint(self.checkpoint, self.training)
        controlled = (state["grad"] and checkpoint != "never") or any(map(draws_random_numbers, self._stages))
        # a stage that drew nothing in an earlier controlled pass in the same modes is left alone: with no lock it
        # overlaps the others (known random layers always draw)
        may_draw = [controlled and (self._quiet_key(s) not in self._quiet or draws_random_numbers(stage))
                    for s, stage in enumerate(self._stages)]
        randoms = stage_randoms(seed, self.devices, may_draw)
        runs = [StageRun(s, n, stage, dev, checkpoint, channel, m, schedule is not None,
                         inputs=microbatches if s == 0 else None, random=random, norms=self._norms, skips=self._skips,
                         **(last if s == n - 1 else {}))
                for s, (stage, dev, random) in enumerate(zip(self._stages, self.devices, randoms))]
        orders = [[Step(s, k, "F") for k in range(m)] for s in range(n)] if schedule is None else \
            stage_orders(schedule(n, m), n, m)
        if self._pool is None:
            self._pool = WorkerPool(threads_per_worker=self.threads_per_stage)
        with _committed(self._norms):
            _run_threads(runs, orders, channel, state, self._pool)
        for s, run in enumerate(runs):
            if run.random is not None:
                (self._quiet.discard if run.random.drew else self._quiet.add)(self._quiet_key(s))
        self.last_timeline = sorted(itertools.chain.from_iterable(r.timeline for r in runs), key=lambda t: t.start)
        return runs[-1]

    def join(self, outputs: list[Any]) -> Any:
        """The micro-batches' outputs concatenated along dim 0 on the last stage's device."""
        return join(outputs, self.devices[-1])

    def forward(self, input: Any) -> Any:
        """The sequential model's output for ``input`` (a tensor or a tuple of them), on the last stage's device."""
        microbatches = self.split(input)
        last = self._pass(microbatches, _caller_state(self.devices))
        return self.join([last.outputs[m] for m in range(len(microbatches))])

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
        check_loss_fn(loss_fn)
        rows = batch_size(input, "input")
        if target is not None and batch_size(target, "target") != rows:
            raise ValueError(f"target has {batch_size(target, 'target')} rows along dim 0 but input has {rows}")
        sizes = split_sizes(rows, self.chunks)
        targets = split(target, sizes, self.devices[-1]) if target is not None else None
        last = self._pass(split(input, sizes, self.devices[0]), _caller_state(self.devices, grad=True),
                          resolve(schedule), targets=targets, loss_fn=loss_fn, weights=loss_weights(sizes, reduction))
        if self.data_parallel_group is not None:
            average_gradients(self.parameters(), self.data_parallel_group)
        return last.loss

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
               f"checkpoint={self.checkpoint!r}, deferred_batch_norm={self.deferred_batch_norm}"


# ---- one stage per process --------------------------------------------------------------------------------------
def _groups(world: int, stages: int) -> tuple[Any, Any]:
    """(this rank's pipeline group, its stage's data-parallel group); every rank creates every group, in order."""
    pipelines = world // stages
    if pipelines == 1:
        return dist.group.WORLD, None
    if stages == 1:
        return None, dist.group.WORLD
    pipe, _ = dist.new_subgroups_by_enumeration([[p * stages + s for s in range(stages)] for p in range(pipelines)])
    dp, _ = dist.new_subgroups_by_enumeration([[p * stages + s for p in range(pipelines)] for s in range(stages)])
    return pipe, dp


class DistributedPipeline(nn.Module):
    """This process's stage of ``module`` cut into ``stages`` stages (default: one per process).

    ``balance``: layer counts per stage, ``"auto"`` or ``"profile"`` (rank 0's timing on ``sample_input`` decides
    for all). ``device``: where this stage runs (default: where its layers are). ``chunks``, ``checkpoint``: as in
    ``Pipeline``. The layers of the other stages are dropped from this process's pipeline (not from ``module``).
    """

    def __init__(self, module: nn.Sequential | Sequence[nn.Module], balance: Sequence[int] | str = "auto",
                 chunks: int = 1, checkpoint: str = "never", deferred_batch_norm: bool = False, *,
                 stages: int | None = None, device: DeviceLike | None = None, sample_input: Any = None) -> None:
        super().__init__()
        require_initialized("DistributedPipeline")
        world, rank = dist.get_world_size(), dist.get_rank()
        stages = world if stages is None else stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or world % stages:
            raise ValueError(f"stages must be an int >= 1 that divides the {world} processes, got {stages!r}")
        self.chunks, self.checkpoint, self.deferred_batch_norm = check_options(chunks, checkpoint,
                                                                                deferred_batch_norm)
        layers = layers_of(module)
        refuse_sync_batchnorm(layers)
        agreed = torch.tensor(resolve_balance(balance, layers, stages, sample_input), dtype=torch.int64)
        # rank 0's on every rank: a timing profile differs from process to process
        group_transport(None, "DistributedPipeline").broadcast(agreed, 0)
        self.balance = agreed.tolist()
        self.stage = rank % stages
        self.num_stages = stages
        self.is_first, self.is_last = self.stage == 0, self.stage == stages - 1
        self.data_parallel_rank, self.data_parallel_size = rank // stages, world // stages
        self._skips = plan_skips(layers, self.balance)
        start = sum(self.balance[:self.stage])
        mine = layers[start:start + self.balance[self.stage]]
        for name, layer in mine:
            self.add_module(name, layer)
        self._local = stage_modules(mine, [len(mine)])  # a list: the layers are registered above
        if device is None:
            device = next((t.device for t in itertools.chain(self.parameters(), self.buffers())), "cpu")
        self.device = normalize_device(device)
        self._local[0].to(self.device)
        self._norms = DeferredNorms(self._local) if deferred_batch_norm else None
        self.pipeline_group, self.data_parallel_group = _groups(world, stages)
        self.ranks = list(range(rank - self.stage, rank - self.stage + stages))
        self._channel = ProcessChannel(self.ranks, torch.device("cpu") if dist.get_backend() == "gloo" else self.device)
        if self.data_parallel_group is not None:
            broadcast_state(itertools.chain(self.parameters(), self.buffers()), self.data_parallel_group)
        self.last_timeline: list[StepTime] = []

    def _start_pass(self, input: Any, checkpointing: bool) -> tuple[list[int], StageRandom | None]:
        """The micro-batch sizes and this stage's random numbers: the first stage's batch size and seed, and whether
        any stage holds a known random layer, in one all-reduce (sum) over the pipeline."""
        head = [0, 0, int(draws_random_numbers(self._local[0]))]
        if self.is_first:
            if input is None:
                raise ValueError(f"rank {dist.get_rank()} runs the first stage: give it the input (the others may "
                                 "pass None)")
            head[:2] = batch_size(input, "input"), pass_seed()
        t = torch.tensor(head, dtype=torch.int64)
        if self.num_stages > 1:
            group_transport(self.pipeline_group, "DistributedPipeline").all_reduce(t).wait()
        rows, seed, random = t.tolist()
        controlled = checkpointing or random > 0  # one stage here: no lock
        return split_sizes(rows, self.chunks), StageRandom(seed, self.stage, self.device) if controlled else None

    def _run(self, run: StageRun, order: list[Step], grad: bool) -> None:
        try:
            with _committed(self._norms), torch.set_grad_enabled(grad), \
                    torch.accelerator.device_index(self.device.index):
                for step in order:
                    run.run(step)
        finally:
            self._channel.finish()
        self.last_timeline = run.timeline

    def forward(self, input: Any = None) -> Any:
        """Evaluation: the pipeline's output on the last stage (None on the others), without autograd."""
        sizes, random = self._start_pass(input, checkpointing=False)
        microbatches = split(input, sizes, self.device) if self.is_first else None
        run = StageRun(self.stage, self.num_stages, self._local[0], self.device, "never", self._channel, len(sizes),
                       train=False, inputs=microbatches, random=random, norms=self._norms, skips=self._skips)
        self._run(run, [Step(self.stage, m, "F") for m in range(len(sizes))], grad=False)
        return join([run.outputs[m] for m in range(len(sizes))], self.device) if self.is_last else None

    def train_step(self, input: Any = None, target: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                   *, schedule: str | ScheduleFn = "1f1b", reduction: str = "mean") -> torch.Tensor:
        """One pipeline's share of a training step: ``Pipeline.train_step``'s semantics, one stage per process.

        ``input`` matters on the first stage, ``target`` on the last (pass None elsewhere). Returns the loss of this
        pipeline's batch on every one of its ranks; with several pipelines, gradients are averaged over them.
        """
        check_loss_fn(loss_fn)
        checkpoint = pass_checkpoint(self.checkpoint, self.training)
        sizes, random = self._start_pass(input, checkpointing=checkpoint != "never")
        targets = None
        if self.is_last and target is not None:
            if batch_size(target, "target") != sum(sizes):
                raise ValueError(f"target has {batch_size(target, 'target')} rows along dim 0 (rank "
                                 f"{dist.get_rank()}) but the first stage's input has {sum(sizes)}")
            targets = split(target, sizes, self.device)
        run = StageRun(self.stage, self.num_stages, self._local[0], self.device, checkpoint, self._channel,
                       len(sizes), True, split(input, sizes, self.device) if self.is_first else None, targets,
                       loss_fn, loss_weights(sizes, reduction), random, self._norms, self._skips)
        orders = stage_orders(resolve(schedule)(self.num_stages, len(sizes)), self.num_stages, len(sizes))
        self._run(run, orders[self.stage], grad=True)
        loss = torch.tensor([run.loss.item() if self.is_last else 0.0], dtype=torch.float64)
        if self.num_stages > 1:  # the last stage's loss to the whole pipeline (src: its rank in the pipeline group)
            group_transport(self.pipeline_group, "DistributedPipeline").broadcast(loss, self.num_stages - 1)
        if self.data_parallel_group is not None:
            average_gradients(self.parameters(), self.data_parallel_group)
        return loss[0]

    def extra_repr(self) -> str:
        return f"stage={self.stage} of {self.num_stages}, balance={self.balance}, device={self.device}, " \
               f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, pipelines={self.data_parallel_size}"
