"""The rank side of the differential DDP harness: a worker loop that takes configurations from a pipe and runs each
with torch's DistributedDataParallel and fanfold's, one after the other, in this process.

Each implementation gets its own default process group (``init_process_group(config.backend)`` over a prefix of
the pool's TCP store), so that an error half-way through one run cannot leave a collective that the other run would
receive. Both start from the same initial weights and see the same data: each rank its own batches. After every
step the gradients (after the synchronised backward) and the parameters and buffers (after the optimizer) are kept;
an exception ends that run and is recorded with the step it came from.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import os
import pickle
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .config import DDPConfig, ZeroConfig, torch_not_run
from .models import batch, build, loss_of, uses_side

PG_TIMEOUT = 30.0  # seconds a collective of the process group (or fanfold's stall inspector) may wait: well below the
# pool's limit per configuration, so that a stuck collective is an exception first
IMPLS = ("fanfold", "torch")
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
           "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Run:
    """One implementation's run on one rank: per step the gradients, then the parameters and buffers after the
    optimizer; ``error``: (exception type, message, step) of the exception that ended it, if any."""

    grads: list[dict] = dataclasses.field(default_factory=list)
    params: list[dict] = dataclasses.field(default_factory=list)
    buffers: list[dict] = dataclasses.field(default_factory=list)
    final: dict | None = None  # parameters after the join context (every rank takes the last one's)
    error: tuple[str, str, int] | None = None


@dataclasses.dataclass
class Step:
    """One step of a run as it finishes, sent at once: what the pool keeps of a rank that then hangs."""

    grads: dict | None
    params: dict
    buffers: dict | None


@dataclasses.dataclass
class RankResult:
    rank: int
    runs: dict[str, Run] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    running: str | None = None  # the implementation this rank was in when it died or hung


def _snap(named) -> dict:
    out = {}
    for name, t in named:
        if t is None:
            out[name] = None
        else:
            t = t.detach()
            out[name] = (t.coalesce().to_dense() if t.is_sparse else t).clone()
    return out


def _grads(model: torch.nn.Module) -> dict:
    return _snap((n, p.grad) for n, p in model.named_parameters())


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _group(name: str, world: int) -> Any:
    if name == "new_group":
        return dist.new_group(list(range(world)))
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def ddp_keywords(config: DDPConfig, model: torch.nn.Module) -> dict:
    """The drawn keywords as DistributedDataParallel takes them (objects built here, on this rank)."""
    kw = config.kw()
    if "process_group" in kw:
        kw["process_group"] = _group("new_group", config.world)
    if "device_mesh" in kw:
        kw["device_mesh"] = _group("1d", config.world)
    if "mixed_precision" in kw:
        from torch.nn.parallel.distributed import _MixedPrecision

        param, _, reduce = kw["mixed_precision"].partition("/")
        kw["mixed_precision"] = _MixedPrecision(param_dtype=_DTYPES[param],
                                                reduce_dtype=_DTYPES[reduce] if reduce else None)
    if "delay_all_reduce_named_params" in kw:
        kw["delay_all_reduce_named_params"] = delayed_params(model)
        first = model.a[0] if isinstance(model.a, torch.nn.Sequential) else model.a
        kw["param_to_hook_all_reduce"] = first.weight  # its gradient comes last in backward
    return kw


def delayed_params(model: torch.nn.Module) -> list:
    """The (name, parameter) pairs drawn as ``delay_all_reduce_named_params``: the head's."""
    return [(n, p) for n, p in model.named_parameters() if n.startswith("head.") and p.requires_grad]


def _library(impl: str):
    if impl == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as lib
    else:
        import fanfold.distributed as lib
    return lib


def torch_user_hook(state, bucket):
    """A user's hook with state, built on the library's all-reduce hook (module level: a DDP is pickled with it)."""
    return _library("torch").allreduce_hook(None, bucket).then(lambda fut: fut.value().mul_(state))


def fanfold_user_hook(state, bucket):
    return _library("fanfold").allreduce_hook(None, bucket).then(lambda fut: fut.value().mul_(state))


def dist_hook(state, bucket):
    """A hook written for torch that calls dist.all_reduce itself."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _hook(impl: str, name: str):
    """(state, hook) for ``register_comm_hook``: the library's own hooks, a user's hook with state, and one
    written for torch that calls ``dist.all_reduce`` itself."""
    if name == "user":
        return 0.5, torch_user_hook if impl == "torch" else fanfold_user_hook
    if name == "user_dist":
        return None, dist_hook
    lib = _library(impl)
    return None, {"allreduce": lib.allreduce_hook, "fp16": lib.fp16_compress_hook,
                  "bf16": lib.bf16_compress_hook}[name]


def _wrap(impl: str, config: DDPConfig, model: torch.nn.Module) -> torch.nn.Module:
    kw = ddp_keywords(config, model)
    if impl == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, **kw)
    import fanfold

    return fanfold.DistributedDataParallel(model, transport=config.transport,
                                           first_bucket_cap_mb=config.first_bucket_cap_mb, **kw)


def _round_trip(wrapper: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(wrapper)
    buf = io.BytesIO()
    pickle.dump(wrapper, buf)
    return pickle.loads(buf.getvalue())


def _train(impl: str, config: DDPConfig, rank: int, run: Run, on_step) -> None:
    dtype = _DTYPES[config.dtype]
    init_seed = config.seed + (rank if config.kw().get("init_sync", True) else 0)  # init_sync makes them equal
    model = build(config.family, dtype, init_seed, config.checkpointing, config.output, config.frozen)
    box = {"ddp": _wrap(impl, config, model)}  # the only reference to the wrapper: "del" drops it
    if config.hook is not None:
        box["ddp"].register_comm_hook(*_hook(impl, config.hook))
    if config.compiled:
        box["net"] = torch.compile(box["ddp"], backend="aot_eager")
    opt = _optimizer(config.optimizer, model)
    joined = box["ddp"].join(divide_by_initial_world_size=config.join == "initial") if config.join \
        else contextlib.nullcontext()
    steps = config.rank_steps(rank)
    step = 0
    with joined:
        for step in range(steps):
            ddp = box["ddp"]
            for micro in range(config.accumulate):
                x, y = batch(config.family, dtype, config.seed, rank, step, micro)
                sync = micro == config.accumulate - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    out = box.get("net", ddp)(x, use_side=uses_side(config.family, rank, step))
                    loss_of(out, y).backward()
                del out
            del ddp
            if config.lifetime == "del" and step == steps - 1:
                box.clear()
                gc.collect()  # the wrapper and its buckets are gone; .grad is read and stepped below
            run.grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=config.set_to_none)
            run.params.append(_snap(model.named_parameters()))
            run.buffers.append(_snap(model.named_buffers()))
            on_step(run)
            if config.lifetime in ("pickle", "deepcopy") and step == 0:
                box["ddp"] = _round_trip(box["ddp"], config.lifetime)
                if config.compiled:  # the copy is what trains on: compiled anew, not the original's compiled wrapper
                    box["net"] = torch.compile(box["ddp"], backend="aot_eager")
                model, state = box["ddp"].module, opt.state_dict()
                opt = _optimizer(config.optimizer, model)
                opt.load_state_dict(state)
    run.final = _snap(model.named_parameters())
    box.clear()


def _train_zero(config: ZeroConfig, rank: int, run: Run, on_step) -> None:
    import fanfold

    dtype = _DTYPES[config.dtype]
    model = build(config.family, dtype, config.seed + rank)
    ddp = fanfold.DistributedDataParallel(model, transport=config.transport, bucket_cap_mb=config.bucket_cap_mb)
    cls, hyper = (torch.optim.Adam, {"lr": 0.01}) if config.optimizer == "adam" else \
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), cls, **hyper)
    if config.stage == 2:
        ddp.shard_gradients(opt)
    for step in range(config.steps):
        x, y = batch(config.family, dtype, config.seed, rank, step)
        loss_of(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        run.params.append(_snap(model.named_parameters()))
        on_step(run)


def _init_group(config, store: Any, tag: str, rank: int) -> None:
    import fanfold  # noqa: F401  (registers the "fanfold" backend)

    dist.init_process_group(config.backend, store=dist.PrefixStore(tag, store), rank=rank,
                            world_size=config.world, timeout=timedelta(seconds=PG_TIMEOUT))


def _end_group(store: Any, tag: str, rank: int, world: int) -> None:
    # every rank leaves its collectives before any closes its connections
    store.set(f"{tag}/left/{rank}", "1")
    store.wait([f"{tag}/left/{r}" for r in range(world)], timedelta(seconds=PG_TIMEOUT))
    dist.destroy_process_group()


def impls_of(config) -> tuple:
    """The implementations a configuration runs, in order: fanfold's DDP and torch's, or fanfold's ZeRO alone."""
    return IMPLS if isinstance(config, DDPConfig) else ("fanfold",)


def run_config(config, rank: int, store: Any, tag: str, send, impls: tuple = IMPLS) -> None:
    """Run ``config``'s implementations (of ``impls``) one after the other, sending ("started", impl) before each,
    ("step", impl, Step) after each of its steps and ("run", impl, Run) after it, then ("done", seconds): a rank that
    dies or hangs in one run leaves the other's result and the steps it finished, and the pool knows which run it
    was in. fanfold's runs first, so that torch's crashing (gloo aborts the process on a mismatched collective)
    cannot hide it."""
    start = time.monotonic()
    for impl in (i for i in impls if i in impls_of(config)):
        send(("started", impl))
        run = Run()
        if impl == "torch" and torch_not_run(config):
            send(("run", impl, dataclasses.replace(run, error=("NotRun", "torch's run left out", 0))))
            continue
        _init_group(config, store, f"{tag}/{impl}", rank)

        def on_step(r: Run, impl=impl) -> None:
            send(("step", impl, Step(r.grads[-1] if r.grads else None, r.params[-1],
                                     r.buffers[-1] if r.buffers else None)))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's and fanfold's deprecation and static_graph notices
                if isinstance(config, ZeroConfig):
                    _train_zero(config, rank, run, on_step)
                else:
                    _train(impl, config, rank, run, on_step)
        except Exception as exc:  # noqa: BLE001 -- the comparison judges it against the other implementation
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            run.error = (type(exc).__name__, detail[:3000], len(run.params))
        gc.collect()  # wrappers and their transports go before their group
        if run.error is not None:
            send(("run", impl, run))  # now: a peer may be waiting for this rank in a collective (pool.GRACE)
        try:
            _end_group(store, f"{tag}/{impl}", rank, config.world)
        except Exception as exc:  # noqa: BLE001 -- a peer still stuck in a collective: a hang, reported as such
            run.error = run.error or (type(exc).__name__, f"{exc} (leaving the process group)", len(run.params))
            dist.destroy_process_group()
        send(("run", impl, run))
    send(("done", time.monotonic() - start))


def serve(rank: int, world: int, port: int, conn: Any) -> None:
    """The worker loop: (tag, configuration) in, RankResult out, until None."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), FANFOLD_STALL_TIMEOUT=str(PG_TIMEOUT))
    os.environ.pop("FANFOLD_TRANSPORT", None)
    torch.set_num_threads(1)
    import fanfold  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=PG_TIMEOUT))

    def send(message) -> None:
        # plain pickle: tensors as bytes, not as shared-memory handles (one segment per tensor, many per step)
        conn.send_bytes(pickle.dumps(message))

    send("ready")
    while True:
        item = conn.recv()
        if item is None:
            return
        tag, config, impls = item
        run_config(config, rank, store, tag, send, impls)
