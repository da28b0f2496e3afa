"""fanfold.pipeline: a sequential model cut into stages, run on micro-batches so that the stages overlap: ``Pipeline``
(stages on threads of one process) and ``DistributedPipeline`` (one stage per process). Design: docs/pipeline.md.
"""
from .partition import balance_by_parameters, balance_by_time
from .pipe import DistributedPipeline, Pipeline
from .schedule import Step, gpipe, one_f_one_b
from .skip import Pop, Stash
from .stage import StepTime

__all__ = ["Pipeline", "DistributedPipeline", "Step", "StepTime", "Stash", "Pop", "gpipe", "one_f_one_b",
           "balance_by_parameters", "balance_by_time"]
