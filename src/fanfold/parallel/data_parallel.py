"""DataParallel and data_parallel(): scatter -> replicate -> parallel_apply -> gather, in one process, each verb a
method a subclass can swap; CPU replicas too. Semantics: docs/data-parallel.md.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from .._core.devices import DeviceLike, default_device_ids, usable_device, usable_devices
from .parallel_apply import WorkerPool, parallel_apply
from .parallel_backward import parallel_apply_backward
from .process_engine import ProcessEngine
from .replicate import LinkedReplicas, link_replicas, replicate
from .scatter_gather import _check_dim, gather, scatter_kwargs


def _accept_unprefixed(module: DataParallel, state_dict: dict, prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: give the keys saved without ``module.`` (by our ``state_dict``) the prefix back."""
    expected = set(module.module.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if rest.startswith("module.") and rest[len("module."):] in expected:
            continue  # already prefixed (a torch.nn.DataParallel checkpoint, or state_dict(prefixed))
        state_dict[prefix + "module." + rest] = state_dict.pop(key)


def _on_device(inputs: tuple, kwargs: dict, device: torch.device) -> bool:
    return all(type(x) is torch.Tensor and x.device == device for x in chain(inputs, kwargs.values()))


class DataParallel(nn.Module):
    """Run ``module`` on several devices of one process, splitting each batch along ``dim``.

    ``device_ids``: accelerator indices, strings or ``torch.device`` objects, repeats allowed (``["cpu"] * 4`` is four
    CPU replicas); default: every accelerator, or none on a CPU-only machine (then the module simply runs). The
    module's parameters and buffers must be on ``device_ids[0]``; outputs are gathered on ``output_device`` (default
    ``device_ids[0]``). ``weights`` or ``chunk_sizes``: how the batch is split. ``parallel_backward``: run several CPU
    replicas' backward in the worker threads (default), not serially on the caller's thread. ``engine``: ``"thread"``
    (default), or ``"process"`` (CPU replicas only: replica 0 in the caller, the others in persistent worker
    processes whose parameters alias the module's in shared memory, each running ``threads // replicas`` intra-op
    threads). ``close()`` stops either.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        weights: Sequence[float] | None = None,
        chunk_sizes: Sequence[int] | None = None,
        parallel_backward: bool = True,
        engine: str = "thread",
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DataParallel wraps an nn.Module (your model), got {type(module).__module__}."
                f"{type(module).__qualname__}. Optimizers and LR schedulers need no wrapping: create them on the "
                "wrapped model's parameters (model.parameters()) and use them unchanged."
            )
        _check_dim(dim)
        if weights is not None and chunk_sizes is not None:
            raise ValueError("DataParallel: give weights or chunk_sizes, not both")
        self.module = module
        self.dim = dim
        self.weights = None if weights is None else list(weights)
        self.chunk_sizes = None if chunk_sizes is None else list(chunk_sizes)
        self.parallel_backward = bool(parallel_backward)
        if engine not in ("thread", "process"):
            raise ValueError(f"DataParallel: engine must be 'thread' or 'process', got {engine!r}")
        self.engine = engine
        linked = next((n for n, m in module.named_modules() if isinstance(m, LinkedReplicas)), None)
        if engine == "process" and linked is not None:  # its replicas meet in threads of one process
            raise ValueError(f"DataParallel: engine='process' cannot run {type(module.get_submodule(linked)).__name__} "
                             f"{linked!r}, whose replicas work together (SyncBatchNorm); use engine='thread'")
        self._processes: ProcessEngine | None = None  # engine="process": started on the first forward
        self._pool: WorkerPool | None = None  # started on the first forward with several replicas
        self.register_load_state_dict_pre_hook(_accept_unprefixed)
        if device_ids is None:
            device_ids = default_device_ids()
            if not device_ids:  # CPU-only machine and no devices asked for: run the module as it is, as torch does
                self.device_ids: list[torch.device] = []
                self.output_device = self.src_device_obj = None
                return
        self.device_ids = usable_devices(device_ids, "device_ids")
        if self.weights is not None and len(self.weights) != len(self.device_ids):
            raise ValueError(f"DataParallel: {len(self.weights)} weights for {len(self.device_ids)} device_ids")
        self.src_device_obj = self.device_ids[0]
        self.output_device = (self.src_device_obj if output_device is None
                              else usable_device(output_device, "output_device"))
        if len(self.device_ids) == 1:
            self.module.to(self.src_device_obj)
        if engine == "process" and any(d.type != "cpu" for d in self.device_ids):
            raise ValueError(f"DataParallel: engine='process' runs CPU replicas only, got device_ids="
                             f"{[str(d) for d in self.device_ids]}; use engine='thread' for accelerators")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        self._check_placement()
        if not inputs and not kwargs:
            return self.module()
        if len(self.device_ids) == 1 and _on_device(inputs, kwargs, self.src_device_obj):
            return self.module(*inputs, **kwargs)  # what scatter would hand over, without its walk of the arguments
        inputs, kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if len(self.device_ids) == 1:
            return self.module(*inputs[0], **kwargs[0])
        if self.engine == "process":  # the replicas live in the worker processes
            if self._processes is None:  # a batch smaller than device_ids uses the first workers only
                self._processes = ProcessEngine(len(self.device_ids))
            return self.gather(self._processes.apply(self.module, inputs, kwargs), self.output_device)
        replicas = self.replicate(self.module, self.device_ids[: len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, kwargs)
        return self.gather(outputs, self.output_device)

    def close(self) -> None:
        """Stop the replicas' worker threads or processes now (garbage collection does it too)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._processes is not None:
            self._processes.close()
            self._processes = None

    def _check_placement(self) -> None:
        # every forward (the module may have moved); the dicts walked directly cost a third of parameters() + buffers()
        src = self.src_device_obj
        for m in self.module.modules():
            for t in chain(m._parameters.values(), m._buffers.values()):
                if t is None or t.device == src:
                    continue
                name = next(n for n, x in chain(self.module.named_parameters(), self.module.named_buffers()) if x is t)
                raise RuntimeError(
                    f"DataParallel: the module's parameters and buffers must be on device_ids[0] = "
                    f"{self.src_device_obj}, but {name} is on {t.device}; move the module first "
                    f"(module.to({str(self.src_device_obj)!r}))"
                )

    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[DeviceLike]) -> tuple[tuple, tuple]:
        return scatter_kwargs(inputs, kwargs, device_ids, self.dim, self.chunk_sizes, weights=self.weights)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        return replicate(module, device_ids, not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence, kwargs: Sequence[dict]) -> list:
        if self._pool is None:
            self._pool = WorkerPool()
        devices = self.device_ids[: len(replicas)]
        concurrent = (self.parallel_backward and len(replicas) > 1 and torch.is_grad_enabled()
                      and not torch.is_inference_mode_enabled() and all(d.type == "cpu" for d in devices))
        link_replicas(self.module, replicas, concurrent)  # SyncBatchNorm's replicas meet in forward and backward
        if concurrent:
            # autograd would run the CPU replicas' backward serially on the caller's thread: run it in the workers
            return parallel_apply_backward(replicas, inputs, kwargs, devices, self._pool)
        return parallel_apply(replicas, inputs, kwargs, devices, pool=self._pool)

    def gather(self, outputs: Sequence, output_device: DeviceLike) -> Any:
        return gather(outputs, output_device, dim=self.dim)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        # a parent calls child.state_dict(destination=, prefix=, keep_vars=): answering for the wrapped module drops
        # "module." at any nesting depth (the version metadata under this prefix is then the wrapped module's)
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")  # absent while unpickling
            if name == "module" or not modules or "module" not in modules:
                raise
            try:
                return getattr(modules["module"], name)
            except AttributeError:
                raise AttributeError(f"neither DataParallel nor the module it wraps "
                                     f"({type(modules['module']).__name__}) has an attribute {name!r}") from None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"] = state["_processes"] = None  # threads and processes are not copied; a copy starts its own
        return state


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
) -> Any:
    """``DataParallel(module, device_ids, output_device, dim)(*inputs, **module_kwargs)`` for one call; ``inputs``: a
    tuple of positional arguments, or one argument."""
    if not isinstance(inputs, tuple):
        inputs = () if inputs is None else (inputs,)
    return DataParallel(module, device_ids, output_device, dim)(*inputs, **(module_kwargs or {}))


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside any DataParallel / DistributedDataParallel (fanfold's or torch's) and
    ``torch.compile`` wrappers, however deeply nested."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"unwrap: expected an nn.Module, got {type(module).__name__}")
    while True:
        inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            inner = module._modules.get("module")  # not getattr: DataParallel's attribute fall-through
            # fanfold's DDP by its module name: the distributed layer is not importable from here
            wrapper = isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or \
                type(module).__module__.startswith("fanfold.")
            if not (wrapper and isinstance(inner, nn.Module)):
                return module
        module = inner
