"""``DistributedPipeline``: one pipeline stage per process (``StageRun`` over a ``ProcessChannel``); with N processes
and ``stages=S``, N/S pipelines of S consecutive ranks whose stage replicas average their gradients after each step.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.devices import DeviceLike, normalize_device
from .._core.job import require_initialized
from ..collectives.stall import group_transport
from .channel import ProcessChannel
from .partition import batch_size, chunk_sizes, join, layers_of, loss_weights, resolve_balance, split, stage_modules
from .pipe import average_gradients, broadcast_state, check_checkpoint, check_chunks
from .rng import StageRandom, draws_random_numbers, pass_seed, stage_randoms
from .schedule import ScheduleFn, Step, resolve, stage_orders
from .stage import StageRun, StepTime

__all__ = ["DistributedPipeline"]


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
                 chunks: int = 1, checkpoint: str = "never", *, stages: int | None = None,
                 device: DeviceLike | None = None, sample_input: Any = None) -> None:
        super().__init__()
        require_initialized("DistributedPipeline")
        world, rank = dist.get_world_size(), dist.get_rank()
        stages = world if stages is None else stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or world % stages:
            raise ValueError(f"stages must be an int >= 1 that divides the {world} processes, got {stages!r}")
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_checkpoint(checkpoint)
        layers = layers_of(module)
        agreed = torch.tensor(resolve_balance(balance, layers, stages, sample_input), dtype=torch.int64)
        # rank 0's on every rank: a timing profile differs from process to process
        group_transport(None, "DistributedPipeline").broadcast(agreed, 0)
        self.balance = agreed.tolist()
        self.stage = rank % stages
        self.num_stages = stages
        self.data_parallel_rank, self.data_parallel_size = rank // stages, world // stages
        start = sum(self.balance[:self.stage])
        mine = layers[start:start + self.balance[self.stage]]
        for name, layer in mine:
            self.add_module(name, layer)
        self._local = stage_modules(mine, [len(mine)])  # a list: the layers are registered above
        if device is None:
            device = next((t.device for t in itertools.chain(self.parameters(), self.buffers())), "cpu")
        self.device = normalize_device(device)
        self._local[0].to(self.device)
        self.pipeline_group, self.data_parallel_group = _groups(world, stages)
        first = rank - self.stage
        self.ranks = list(range(first, first + stages))
        self._wire = torch.device("cpu") if dist.get_backend() == "gloo" else self.device
        self._channel = ProcessChannel(self.ranks, self._wire)
        if self.data_parallel_group is not None:
            broadcast_state(itertools.chain(self.parameters(), self.buffers()), self.data_parallel_group)
        self.last_timeline: list[StepTime] = []

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _start_pass(self, input: Any, checkpointing: bool) -> tuple[list[int], StageRandom | None]:
        """The micro-batch sizes and this stage's random numbers for a pass: the first stage's batch size and seed
        (the masks of a one-process Pipeline seeded alike), and whether any stage holds a known random layer, in one
        all-reduce (sum; only the first stage gives the first two) over the pipeline."""
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
        randoms = stage_randoms(seed, [self.device], self.stage, checkpointing or random > 0)
        return chunk_sizes(rows, self.chunks), randoms[0]

    def _run(self, run: StageRun, order: list[Step], grad: bool) -> None:
        try:
            with torch.set_grad_enabled(grad), torch.accelerator.device_index(self.device.index):
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
                       train=False, inputs=microbatches, random=random)
        self._run(run, [Step(self.stage, m, "F") for m in range(len(sizes))], grad=False)
        return join([run.outputs[m] for m in range(len(sizes))], self.device) if self.is_last else None

    def train_step(self, input: Any = None, target: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                   *, schedule: str | ScheduleFn = "1f1b", reduction: str = "mean") -> torch.Tensor:
        """One pipeline's share of a training step: ``Pipeline.train_step``'s semantics, one stage per process.

        ``input`` matters on the first stage, ``target`` on the last (pass None elsewhere). Returns the loss of this
        pipeline's batch on every one of its ranks; with several pipelines, gradients are averaged over them.
        """
        if not callable(loss_fn):
            raise TypeError(f"train_step needs loss_fn, a function (output, target) -> 0-dim loss, got {loss_fn!r}")
        sizes, random = self._start_pass(input, checkpointing=self.checkpoint != "never")
        targets = None
        if self.is_last and target is not None:
            if batch_size(target, "target") != sum(sizes):
                raise ValueError(f"target has {batch_size(target, 'target')} rows along dim 0 (rank "
                                 f"{dist.get_rank()}) but the first stage's input has {sum(sizes)}")
            targets = split(target, sizes, self.device)
        run = StageRun(self.stage, self.num_stages, self._local[0], self.device, self.checkpoint, self._channel,
                       len(sizes), True, split(input, sizes, self.device) if self.is_first else None, targets,
                       loss_fn, loss_weights(sizes, reduction), random)
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
