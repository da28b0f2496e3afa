"""What the differential DDP tests draw: a configuration (a small frozen dataclass, pickled to the rank workers), the
hypothesis strategies that draw it, and ``KNOWN_DEFECTS``, the one place that names draws skipped for a defect
being fixed elsewhere.

Keywords that take objects (a process group, a device mesh, the delayed parameters, mixed precision) are drawn as
names and built in the rank (``ranks.py``).
"""
from __future__ import annotations

import dataclasses
import inspect
import random
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from .models import FAMILIES

# torch 2.13's DistributedDataParallel keywords the harness draws (``module`` is the model; ``output_device`` and
# ``dim`` only matter to torch's CUDA scatter and are drawn at their values for a CPU module)
TORCH_KEYWORDS = tuple(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)[1:]


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    world: int = 2
    backend: str = "gloo"  # the process group both DDPs share: "gloo" or "fanfold" (fanfold's registered backend)
    transport: str | None = "shm"  # fanfold's transport= ("shm", "torch", None: the default for the group)
    family: str = "mlp"
    dtype: str = "float64"
    output: str = "tensor"  # "tensor", "tuple", "dict"
    frozen: bool = False
    checkpointing: str | None = None  # None, "reentrant", "non_reentrant"
    steps: int = 2
    optimizer: str = "sgd"  # "sgd" (momentum 0.9) or "adam"
    set_to_none: bool = True  # zero_grad(set_to_none=...)
    accumulate: int = 1  # micro-steps per step, all but the last under no_sync()
    join: str | None = None  # None, "initial" or "active" (divide_by_initial_world_size True / False)
    batches: tuple[int, ...] = ()  # steps per rank under join (uneven); else every rank runs ``steps``
    hook: str | None = None  # None, "allreduce", "fp16", "bf16", "user" (state + then), "user_dist" (dist.all_reduce)
    lifetime: str | None = None  # None, "del" (after the last backward), "pickle", "deepcopy" (after step 0)
    compiled: bool = False  # the wrapper under torch.compile(backend="aot_eager")
    keywords: tuple[tuple[str, object], ...] = ()  # DDP keywords away from their defaults (name, drawn value)
    first_bucket_cap_mb: float | None = None  # fanfold's own keyword
    seed: int = 0

    def kw(self) -> dict:
        return dict(self.keywords)

    def rank_steps(self, rank: int) -> int:
        return self.batches[rank] if self.join else self.steps

    @property
    def fanfold_transport(self) -> str:
        """What fanfold's DDP communicates through: "shm", "torch" or "backend" (the fanfold group's own)."""
        if self.transport is not None:
            return self.transport
        return "backend" if self.backend == "fanfold" else "shm"


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """fanfold's DDP + ``ZeroRedundancyOptimizer`` (stage 1, or 2 with ``shard_gradients``) against torch's
    optimizer on the whole batch in one process."""

    world: int = 2
    backend: str = "gloo"
    transport: str | None = "shm"
    family: str = "mlp"
    dtype: str = "float64"
    stage: int = 1
    optimizer: str = "sgd"
    steps: int = 2
    bucket_cap_mb: float | None = None
    seed: int = 0


# ---- known defects, fixed on other branches: drawn, then skipped; the lead deletes each entry after merging ------

KNOWN_DEFECTS: dict[str, Callable[[DDPConfig], bool]] = {
    # torch's own, not fanfold's: torch's DDP under join() with sparse gradients waits in an all_reduce the joined
    # rank never issues (its join matches a sparse bucket with a dense all-reduce); on gloo it hangs alike, on the
    # fanfold backend it ends in ShmTimeoutError naming the joined rank after the stall timeout. Skipped only to
    # spare that wait; fanfold's DDP under join with sparse gradients is still drawn on gloo groups.
    "torch-ddp-join-sparse-on-fanfold-backend": lambda c: c.backend == "fanfold" and bool(c.join) and
    c.family == "sparse_embedding",
}


def known_defect(config: object) -> str | None:
    """The name of the known defect ``config`` would hit, or None."""
    if not isinstance(config, DDPConfig):
        return None
    return next((name for name, hits in KNOWN_DEFECTS.items() if hits(config)), None)


def torch_not_run(c: DDPConfig) -> bool:
    """fanfold refuses join() with skip_all_reduce_unused_params (listed) on every rank alike; torch's DDP then
    waits in gloo until the group's timeout or aborts the process, so its run is left out."""
    return bool(c.join) and bool(c.kw().get("skip_all_reduce_unused_params"))


# ---- strategies -----------------------------------------------------------------------------------------------

_CAPS = st.sampled_from([None, 1e-5, 1e-4, 0.001, 25.0, 1000.0])


@st.composite
def _keywords(draw, family: str) -> tuple:
    """Each keyword at its default most of the time, so that draws combine a few of them. The coin is a
    ``random.Random`` seeded by hypothesis: its probabilities hold (``st.floats`` and ``st.randoms`` favour 0.0 and
    would switch every keyword on), and the draw still replays from hypothesis's choices."""
    coin = random.Random(draw(st.integers(0, 2**32 - 1)))
    kw: dict = {}

    def maybe(name, values, p=0.25):
        if coin.random() < p:
            kw[name] = values[coin.randrange(len(values))]

    maybe("bucket_cap_mb", [1e-5, 1e-4, 0.001, 25.0, 1000.0], 0.5)
    maybe("bucket_cap_mb_list", [[1e-5], [1e-4, 1e-5], [0.001, 25.0]], 0.1)
    maybe("gradient_as_bucket_view", [True])
    maybe("find_unused_parameters", [True], 0.5 if family.startswith("branch") else 0.15)
    maybe("static_graph", [True], 0.15)
    maybe("broadcast_buffers", [True, False], 0.15)
    maybe("forward_sync_buffers", [True, False], 0.15)
    maybe("init_sync", [False], 0.15)
    maybe("check_reduction", [True], 0.05)
    maybe("batched_grad_copy", [True], 0.15)
    if family != "branch_rank":  # its contract (torch's and fanfold's): the same unused parameters on every rank
        maybe("skip_all_reduce_unused_params", [True], 0.1)
    maybe("mixed_precision", ["float16", "bfloat16", "bfloat16/float32"], 0.06)
    maybe("delay_all_reduce_named_params", ["head"], 0.06)  # with param_to_hook_all_reduce: a.weight
    maybe("process_group", ["new_group"], 0.08)
    if "process_group" not in kw:  # both: torch's RuntimeError, and nothing else to see
        maybe("device_mesh", ["1d"], 0.04)
    maybe("device_ids", [["cpu"]], 0.04)
    maybe("output_device", ["cpu"], 0.03)
    maybe("dim", [1], 0.03)
    return tuple(sorted(kw.items()))


@st.composite
def ddp_configs(draw, worlds=(2, 3), compile_p: float = 0.02) -> DDPConfig:
    world = draw(st.sampled_from(worlds))
    backend = draw(st.sampled_from(["gloo", "fanfold"]))
    transport = draw(st.sampled_from(["shm", "torch", None]))
    family = draw(st.sampled_from(FAMILIES))
    checkpointing = draw(st.sampled_from([None, None, "reentrant", "non_reentrant"]))
    steps = draw(st.integers(1, 3))
    join = draw(st.sampled_from([None, None, "initial", "active"]))
    # a wrapper deleted, pickled or copied inside its own join() context is no use anyone has
    batches = tuple(draw(st.integers(1, 3)) for _ in range(world)) if join else ()
    sparse = family == "sparse_embedding"
    keywords = draw(_keywords(family))
    if family == "branch_rank" and not (dict(keywords).get("find_unused_parameters") or
                                        dict(keywords).get("static_graph")):
        # without them a branch unused on some ranks is the user's error; torch's ranks that used it then wait for
        # the others' bucket until the group's timeout, fanfold raises on the ranks that did not (listed). The
        # error itself is drawn with branches unused on every rank ("branch_step", "branch_never").
        keywords = tuple(sorted(dict(keywords, find_unused_parameters=True).items()))
    return DDPConfig(
        world=world, backend=backend, transport=transport, family=family,
        dtype=draw(st.sampled_from(["float64", "float32"])),
        output=draw(st.sampled_from(["tensor", "tensor", "tuple", "dict"])),
        frozen=draw(st.booleans()), checkpointing=checkpointing, steps=steps,
        optimizer="sgd" if sparse else draw(st.sampled_from(["sgd", "adam"])),  # torch's Adam takes no sparse grad
        set_to_none=draw(st.booleans()), accumulate=draw(st.sampled_from([1, 1, 2, 3])), join=join, batches=batches,
        hook=draw(st.sampled_from([None, None, "allreduce", "fp16", "bf16", "user", "user_dist"])),
        lifetime=None if join else draw(st.sampled_from([None, None, None, "del", "pickle", "deepcopy"])),
        compiled=random.Random(draw(st.integers(0, 2**32 - 1))).random() < compile_p,
        keywords=keywords,
        first_bucket_cap_mb=None if "bucket_cap_mb_list" in dict(keywords)  # fanfold refuses both: one cap
        else draw(st.sampled_from([None, None, None, 1e-5])),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def zero_configs(draw, worlds=(2, 3)) -> ZeroConfig:
    return ZeroConfig(
        world=draw(st.sampled_from(worlds)), backend=draw(st.sampled_from(["gloo", "fanfold"])),
        transport=draw(st.sampled_from(["shm", "torch", None])),
        family=draw(st.sampled_from(["mlp", "conv_bn", "tied", "embedding"])),  # not "buffers": its forward
        # changes the buffer, so one model over W batches is not W replicas over one each
        dtype=draw(st.sampled_from(["float64", "float32"])), stage=draw(st.sampled_from([1, 2])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])), steps=draw(st.integers(1, 3)),
        bucket_cap_mb=draw(_CAPS), seed=draw(st.integers(0, 2**16)),
    )
