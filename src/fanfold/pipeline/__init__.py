"""fanfold.pipeline: model parallelism. A sequential model cut into stages, run on micro-batches so stages overlap.

Layers, bottom up: ``schedule`` (which stage runs which micro-batch's forward/backward, clock by clock) and
``partition`` (cutting the model: balance) <- ``microbatch`` (split and join, fanfold's scatter/gather),
``channel`` / ``p2p`` (stages hand each other activations and gradients: queues between threads, torch.distributed
between processes) and ``rng`` (each micro-batch and stage's own generator state) <- ``stage`` (one stage's forward
and backward steps) <- ``execute`` (driving the stages on one thread or a thread each) <- ``pipe`` (``Pipeline``,
one process) and ``distributed`` (``DistributedPipeline``, one stage per process, and data parallelism over
pipelines; ``grads``).
"""
from .distributed import DistributedPipeline
from .partition import balance_by_parameters, balance_by_time
from .pipe import Pipeline
from .schedule import Step, gpipe, one_f_one_b
from .stage import StepTime

__all__ = [
    "Pipeline",
    "DistributedPipeline",
    "Step",
    "StepTime",
    "gpipe",
    "one_f_one_b",
    "balance_by_parameters",
    "balance_by_time",
]
