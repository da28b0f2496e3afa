"""DistributedDataParallel: one process per replica, gradients averaged by ``reducer.py``; every keyword of torch's
DDP with torch's meaning (docs/ddp-compat.md), the construction's collectives, torch's optimizers in backward."""
from __future__ import annotations

import hashlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._core.devices import normalize_device
from .._core.eager import eager
from .._core.tree import flatten, unflatten
from ..collectives.objects import all_gather_object
from ..collectives.protocol import Transport
from ..collectives.select import resolve_transport
from ..collectives.stall import inspected
from .join import BACKWARD, FORWARD, DDPParticipant, JoinState
from .reducer import Reducer, ShardsGradients, bucket_caps

__all__ = ["DistributedDataParallel", "DDP"]

# What cannot be combined with optimizers in backward, and why
_HOOK = ("a comm hook (register_comm_hook) is set: torch's DDP refuses this too, as its step after the all-reduce "
         "is a comm hook of its own and a DDP takes one")
_MIXED = "mixed_precision is set: torch's DDP refuses this too, as its mixed precision is a comm hook of its own"
_STAGE2 = "shard_gradients() (ZeRO stage 2) keeps only this rank's part of each averaged gradient"
_JOIN = "join() (uneven inputs): a rank that has joined has no backward to step the optimizers in"
BROADCAST_BYTES = 64 * 1024 * 1024


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"DistributedDataParallel: {name} must be True or False, got {value!r}")
    return value


def _process_group(process_group: Any, device_mesh: Any) -> Any:
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("DistributedDataParallel: Cannot specify both process_group and device_mesh arguments.")
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {device_mesh!r}")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"DistributedDataParallel: Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        raise NotImplementedError(
            "DistributedDataParallel: device_mesh sliced out of a larger mesh (data parallel combined with tensor "
            "parallel, DTensor parameters) is not supported by fanfold; pass a 1-D mesh of the data-parallel ranks")
    return device_mesh.get_group(mesh_dim=0)


def _buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(buffers synced before every training forward, buffers in the broadcast at construction)."""
    if broadcast_buffers is not None:
        _flag("broadcast_buffers", broadcast_buffers)
        warnings.warn("DistributedDataParallel: `broadcast_buffers` is deprecated (torch 2.13); use "
                      "`forward_sync_buffers`. Unlike broadcast_buffers=False, forward_sync_buffers=False still syncs "
                      "buffers at construction." + (" `forward_sync_buffers` takes precedence over it, as in torch."
                                                    if forward_sync_buffers is not None else ""),
                      FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return _flag("forward_sync_buffers", forward_sync_buffers), True
    return (True, True) if broadcast_buffers is None else (broadcast_buffers, broadcast_buffers)


def _delayed(module: nn.Module, named: Any, hook_param: Any) -> list[str]:
    if (named is None) != (hook_param is None):
        raise ValueError("DistributedDataParallel: delay_all_reduce_named_params and param_to_hook_all_reduce need "
                         "to be set at the same time.")
    if named is None:
        return []
    params = dict(module.named_parameters())
    names = []
    for entry in named:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and params.get(entry[0]) is entry[1]):
            raise ValueError(f"delay_all_reduce_named_params must hold (name, parameter) pairs of the module, as "
                             f"module.named_parameters() gives them; got {entry!r}")
        names.append(entry[0])
    if not any(hook_param is p for p in params.values()):
        raise ValueError(f"param_to_hook_all_reduce must be a parameter of the module, got a tensor of shape "
                         f"{tuple(getattr(hook_param, 'shape', ()))}")
    return names


def _devices(module: nn.Module, device_ids: list | None, output_device: Any) -> tuple:
    """(device_ids, output_device): None for both, or this process's one device where every parameter is."""
    if device_ids is None:
        return None, None
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise ValueError(f"device_ids must be None or one device (this process's), got {device_ids!r}: "
                         "DistributedDataParallel runs one process per device")
    dev = normalize_device(device_ids[0])
    wrong = [n for n, p in module.named_parameters() if normalize_device(p.device) != dev]
    if wrong:
        raise ValueError(f"device_ids={device_ids!r} but parameter {wrong[0]!r} is on another device: move the "
                         f"module to {dev} before wrapping it")
    return [dev], normalize_device(output_device) if output_device is not None else dev


def _sparse_flags(module: nn.Module, names: Sequence[str]) -> list[bool]:
    # torch's DDP treats as sparse the weight of an nn.Embedding or nn.EmbeddingBag built with sparse=True
    sparse = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            sparse.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False))
    return [n in sparse for n in names]


def check_same_model(t: Transport, module: nn.Module, ignored: frozenset = frozenset()) -> None:
    """Fail on every rank, naming the first difference, when the models differ: a fixed-size digest first (no hang)."""
    entries = [f"parameter {n!r} shape {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
               for n, p in module.named_parameters() if n not in ignored]
    entries += [f"buffer {n!r} shape {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers() if n not in ignored]
    digest = torch.tensor(list(hashlib.sha256("\n".join(entries).encode()).digest()[:16]), dtype=torch.uint8)
    rows = torch.empty(t.world_size, digest.numel(), dtype=torch.uint8)
    t.all_gather(digest, rows.view(-1)).wait()
    differ = [r for r in range(t.world_size) if not torch.equal(rows[r], rows[0])]
    if not differ:
        return
    lists = all_gather_object(entries, transport=t)
    r = differ[0]
    k = next((k for k, (a, b) in enumerate(zip(lists[0], lists[r])) if a != b), min(len(lists[0]), len(lists[r])))
    mine, theirs = (x[k] if k < len(x) else "nothing (its model ends there)" for x in (lists[0], lists[r]))
    raise RuntimeError(
        f"DistributedDataParallel (rank {t.rank}): the model differs between ranks {[0] + differ}: at entry {k} "
        f"rank 0 has {mine} but rank {r} has {theirs}. Every rank must build the same model (same code, "
        "arguments and checkpoint) before wrapping it.")


def broadcast_tensors(t: Transport, tensors: list[torch.Tensor], src: int) -> None:
    """Broadcast ``tensors`` in place from ``src``: their bytes end to end, one collective per device (and 64 MiB)."""
    groups: dict[torch.device, list[list[torch.Tensor]]] = {}
    # widest elements first: every tensor's bytes then start at a multiple of its element size (view(dtype) needs it)
    for tensor in sorted(tensors, key=lambda x: -x.element_size()):
        chunks = groups.setdefault(tensor.device, [[]])
        if chunks[-1] and sum(x.numel() * x.element_size() for x in chunks[-1]) >= BROADCAST_BYTES:
            chunks.append([])
        chunks[-1].append(tensor)
    with torch.no_grad():
        for chunk in (c for chunks in groups.values() for c in chunks):
            flat = torch.cat([x.reshape(-1).view(torch.uint8) for x in chunk])
            t.broadcast(flat, src)
            for x, part in zip(chunk, flat.split([x.numel() * x.element_size() for x in chunk])):
                x.copy_(part.view(x.dtype).view_as(x))


class MixedPrecision:
    """torch's ``mixed_precision=_MixedPrecision(...)``, on any device: low-precision copies of ``module``'s parameters
    during forward and backward; the masters otherwise."""

    def __init__(self, config: Any, module: nn.Module):
        if not all(hasattr(config, a) for a in ("param_dtype", "reduce_dtype", "buffer_dtype")):
            raise TypeError("mixed_precision must be torch.nn.parallel.distributed._MixedPrecision (or have "
                            f"param_dtype, reduce_dtype and buffer_dtype), got {config!r}")
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(config, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"mixed_precision.{name} must be None or a floating-point torch.dtype, got {value!r}")
        self.param_dtype, self.buffer_dtype = config.param_dtype, config.buffer_dtype
        self.reduce_dtype = config.reduce_dtype or config.param_dtype
        self.module = module
        self._masters: list[tuple[nn.Parameter, torch.Tensor]] | None = None
        self.graph = False  # a forward with grad ran on the copies: its backward needs them

    def cast_buffers(self) -> None:
        if self.buffer_dtype is None:
            return
        for buf in self.module.buffers():
            if buf.is_floating_point():
                buf.data = buf.data.to(self.buffer_dtype)

    def cast(self, inputs: Any) -> Any:
        """Before a forward: the parameters' data become low-precision copies of the masters, and so do the inputs."""
        if self.param_dtype is None:
            return inputs
        grad = torch.is_grad_enabled()
        self.graph = self.graph or grad
        if self._masters is None:
            self._masters = [(p, p.data) for p in self.module.parameters()]
        with torch.no_grad():
            for p, master in self._masters:
                p.data = master.to(self.param_dtype)
                # as torch does, since the backward accumulates into it
                if grad and p.grad is not None and p.grad.dtype != self.param_dtype:
                    p.grad = p.grad.to(self.param_dtype)
        return _map_tensors(inputs, lambda x: x.to(self.param_dtype) if x.is_floating_point() else x)

    def restore(self) -> None:
        """The masters back; a low-precision gradient becomes full precision."""
        self.graph = False
        if self._masters is None:
            return
        with torch.no_grad():
            for p, master in self._masters:
                p.data = master
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
        self._masters = None


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` (already on this process's device) for data-parallel training over a process group.

    Takes every keyword of torch's DistributedDataParallel (2.13), each with torch's meaning or refused with an
    error (``docs/ddp-compat.md``), plus ``transport`` ("torch", "shm" or a ``collectives.Transport``; default
    ``$FANFOLD_TRANSPORT``, else "shm" when every rank shares this host and its CPU, "torch" otherwise),
    ``first_bucket_cap_mb`` (1 MiB) and ``stall_timeout`` (seconds a collective may wait before ``StallError``
    names the ranks that never arrived; default ``$FANFOLD_STALL_TIMEOUT`` or 300).
    """

    def __init__(
        self, module: nn.Module, device_ids: list | None = None, output_device: Any = None, dim: int = 0,
        broadcast_buffers: bool | None = None, init_sync: bool = True, process_group: Any = None,
        bucket_cap_mb: float | None = None, find_unused_parameters: bool = False, check_reduction: bool = False,
        gradient_as_bucket_view: bool = False, static_graph: bool = False, delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None, mixed_precision: Any = None, device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list: list | None = None,
        batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None, *, transport: Any = None,
        first_bucket_cap_mb: float | None = None, stall_timeout: float | None = None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        # torch's keywords, each checked before any collective
        self.process_group = _process_group(process_group, device_mesh)
        self.forward_sync_buffers, init_sync_buffers = _buffer_sync(broadcast_buffers, forward_sync_buffers)
        if _flag("check_reduction", check_reduction):
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please "
                          "avoid using it. (It has no effect in torch either: the reducer always completes the "
                          "reduction.)", FutureWarning, stacklevel=2)
        self._caps = bucket_caps(bucket_cap_mb, first_bucket_cap_mb, bucket_cap_mb_list)
        self.static_graph = _flag("static_graph", static_graph)
        self.find_unused_parameters = _flag("find_unused_parameters", find_unused_parameters)
        if static_graph and find_unused_parameters:
            warnings.warn("DistributedDataParallel: find_unused_parameters=True is not needed with static_graph=True, "
                          "which finds the unused parameters in the first iteration (they must stay unused).",
                          stacklevel=2)
        self.gradient_as_bucket_view = _flag("gradient_as_bucket_view", gradient_as_bucket_view)
        _flag("batched_grad_copy", batched_grad_copy)  # what fanfold always does: a bucket's copies together
        self._skip_unused = _flag("skip_all_reduce_unused_params", skip_all_reduce_unused_params)
        self._delayed = _delayed(module, delay_all_reduce_named_params, param_to_hook_all_reduce)
        self.module = module
        self.dim, self.device_mesh, self.mixed_precision = dim, device_mesh, mixed_precision
        # torch's: names set by _set_params_and_buffers_to_ignore_for_model, left out of every collective
        self.parameters_to_ignore = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.device_ids, self.output_device = _devices(module, device_ids, output_device)
        # torch's: gradients synced in the next backward, buffers before the next forward
        self.require_backward_grad_sync = self.require_forward_param_sync = True
        self._transport_arg, self._stall_timeout, self._comm_hook = transport, stall_timeout, None
        self._mp = MixedPrecision(mixed_precision, module) if mixed_precision is not None else None
        self._join: JoinState | None = None
        self._had_buffers = bool(self._module_buffers())  # torch's: else no walk per forward
        self.transport = inspected(resolve_transport(transport, self.process_group, stall_timeout), stall_timeout,
                                   "DistributedDataParallel")
        if init_sync:  # first, so that a model that differs between ranks is named as such on every rank
            check_same_model(self.transport, module, self.parameters_to_ignore)
        if not self._delayed and not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError(f"DistributedDataParallel is not needed when a module doesn't have any parameter that "
                               f"requires a gradient ({type(module).__name__} has none): there is nothing to average")
        if init_sync:
            tensors = self._module_params() + (self._module_buffers() if init_sync_buffers else [])
            broadcast_tensors(self.transport, tensors, 0)
        if self._mp is not None:
            self._mp.cast_buffers()
        self._build_reducer()

    broadcast_buffers = property(lambda self: self.forward_sync_buffers,  # torch's older name
                                 lambda self, value: setattr(self, "forward_sync_buffers", value))

    def _build_reducer(self) -> None:
        params = dict(self.module.named_parameters())
        names = [n for n, p in params.items() if p.requires_grad and n not in self._delayed and
                 n not in self.parameters_to_ignore]
        # mixed precision: torch's .grad is a full-precision copy, never a bucket view: the reducer's copying path
        self.reducer = Reducer(
            [params[n] for n in names], names, self.transport, self._caps, self.find_unused_parameters,
            self.gradient_as_bucket_view and self._mp is None, static_graph=self.static_graph,
            sparse=_sparse_flags(self.module, names), reduce_dtype=self._mp.reduce_dtype if self._mp else None,
            skip_unused=self._skip_unused, delayed=[params[n] for n in self._delayed if params[n].requires_grad])
        if self._comm_hook is not None:
            self.reducer.set_comm_hook(*self._comm_hook)
        if self._mp is not None:
            self.reducer.params_back = self._mp.restore
        for m in self.module.modules():  # SyncBatchNorm: its collectives may share DDP's transport
            if isinstance(m, DDPParticipant):
                m.use_transport(self.transport, self.process_group)

    def _ensure_built(self) -> None:
        """After unpickling: every rank builds the transport and the reducer at the copy's first forward."""
        if self.reducer is None:
            self.transport = inspected(resolve_transport(self._transport_arg, self.process_group, self._stall_timeout),
                                       self._stall_timeout, "DistributedDataParallel")
            self._build_reducer()

    def _module_buffers(self) -> list[torch.Tensor]:
        # looked up each time: .to() or load_state_dict(assign=True) replace them
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _module_params(self) -> list[torch.Tensor]:
        return [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch's private, widely used way to leave named parameters and buffers out of DDP; call before wrapping."""
        names = set(params_and_buffers_to_ignore)
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            if name in names:
                t._ddp_ignored = True  # torch's mark, read by its FSDP and by torch.compile's DDP optimizer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Under torch.compile only the module is traced: the bookkeeping and collectives around it run eagerly, as
        # torch's DDP keeps its own out of the graph (dynamo cannot trace the transports' threads, finalizers, locks).
        inputs, kwargs, sync = eager(self._pre_forward, inputs, kwargs)
        out = self.module(*inputs, **kwargs)
        eager(self._post_forward, out, sync)
        return out

    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        self._ensure_built()
        if self.reducer.unfinished is not None and torch.is_grad_enabled():
            raise RuntimeError(self.reducer.unfinished)  # torch's: before any collective of this forward
        if self.reducer.in_backward is None:
            self._take_over_in_backward_optimizers()
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        buffers = self._module_buffers() if self._had_buffers and self.forward_sync_buffers and \
            self.require_forward_param_sync else []
        src = 0
        if self._join is not None:
            _, src = self._join.announce(FORWARD, bool(buffers))
        if buffers:
            # In place without a version bump, as torch does: a first forward's saved buffers stay usable.
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                broadcast_tensors(self.transport, buffers, src)
        if grad:  # as torch: a forward without grad leaves a pending backward's synchronisation alone
            self.reducer.prepare_for_forward(sync)
        if self.device_ids and self.device_ids[0].type != "cpu":
            inputs, kwargs = _map_tensors((inputs, kwargs), lambda x: x.to(self.device_ids[0], non_blocking=True))
        if self._mp is not None:
            inputs, kwargs = self._mp.cast((inputs, kwargs))
        return inputs, kwargs, sync

    def _post_forward(self, out: Any, sync: bool) -> None:
        grad = torch.is_grad_enabled()
        self.require_forward_param_sync = sync
        if grad and (sync or self._mp is not None):
            # The end of backward is queued where the backward reaches an output, in the outermost autograd pass. A
            # weak reference: outputs kept by the user must not keep the wrapper alive.
            ref = weakref.ref(self.reducer)
            for _, t in flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(lambda grad: None if ref() is None else ref().backward_started())
        elif self._mp is not None and not self._mp.graph:
            # no backward of this forward can follow, nor one of an earlier forward, which saved the copies
            self._mp.restore()

    def _take_over_in_backward_optimizers(self) -> None:
        # torch's DDP at its first forward: optimizers that _apply_optimizer_in_backward gave its parameters step on
        # the averaged gradient, not on this rank's: their hooks go
        r = self.reducer
        conflict = (_HOOK if self._comm_hook is not None else _MIXED if self._mp is not None else
                    _STAGE2 if r.strategy is not None else _JOIN if self._join is not None else None)
        found = [i for i, p in enumerate(r.params) if hasattr(p, "_in_backward_optimizers")]
        if conflict is not None:
            self._refuse_with_in_backward(conflict, found)
        # the handles live in torch's module, imported by whoever called _apply_optimizer_in_backward
        torch_module = sys.modules.get("torch.distributed.optim.apply_optimizer_in_backward")
        handles = getattr(torch_module, "param_to_optim_hook_handle_map", {}) if found else {}
        for i in found:
            for handle in handles.get(r.params[i], ()):
                handle.remove()
        r.in_backward = found

    def _refuse_with_in_backward(self, what: str, found: list[int] | None = None) -> None:
        names = [self.reducer.names[i] for i in (self.reducer.in_backward if found is None else found) or ()]
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise RuntimeError(
                f"DistributedDataParallel (rank {self.transport.rank}): {what}; it cannot be combined with optimizers "
                "applied in backward (torch.distributed.optim._apply_optimizer_in_backward), which DDP steps on the "
                f"averaged gradient. Parameters with such optimizers: {shown}.")

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised backward averages the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def _set_static_graph(self) -> None:
        """torch's (private, widely used) way to ask for ``static_graph=True`` after construction."""
        self._ensure_built()
        if not self.static_graph and self.reducer.rebuilt:
            raise RuntimeError("DistributedDataParallel._set_static_graph() must be called before the first "
                               "synchronised backward (the first iteration is the one that is observed)")
        self.static_graph = self.reducer.static = True

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> future`` (see ``comm_hooks``)."""
        self._ensure_built()
        self._refuse_with_in_backward(_HOOK)
        self.reducer.set_comm_hook(state, hook)
        self._comm_hook = (state, hook)

    def shard_gradients(self, optimizer: Any) -> None:
        """ZeRO stage 2 with ``optimizer`` (a ``fanfold.ZeroRedundancyOptimizer`` of this model's parameters): this rank
        keeps the average of its part of each bucket, ``.grad`` stays None. Collective."""
        self._ensure_built()
        self._refuse_with_in_backward(_STAGE2)
        if not isinstance(optimizer, ShardsGradients):
            raise TypeError(f"DistributedDataParallel.shard_gradients (rank {self.transport.rank}): optimizer must be "
                            f"a fanfold.ZeroRedundancyOptimizer, got {type(optimizer).__name__}")
        self.reducer.use_strategy(optimizer.gradient_strategy, "DistributedDataParallel.shard_gradients")

    @contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Train on uneven inputs: a rank that leaves the block shadows the others' collectives until all leave;
        then every rank takes the parameters and buffers of the highest of the ranks that joined last, as torch's DDP
        does (and during the block, buffers come from the highest active rank, as torch's)."""
        if not enable:
            yield
            return
        if self._join is not None:
            raise RuntimeError("DistributedDataParallel.join() contexts cannot be nested")
        if self._skip_unused:
            raise NotImplementedError("DistributedDataParallel.join() with skip_all_reduce_unused_params=True: a rank "
                                      "that has joined cannot tell which buckets the others skip")
        if self.reducer is not None and self.reducer.strategy is not None:
            raise NotImplementedError("DistributedDataParallel.join() with shard_gradients(): a joined rank would "
                                      "have to step its part of the optimizer too")
        self._ensure_built()
        self._refuse_with_in_backward(_JOIN)
        state = JoinState(self.transport, throw_on_early_termination)
        state.begin_backward = self.reducer.begin_backward
        participants = [m for m in self.module.modules() if isinstance(m, DDPParticipant)]

        def on_alive(alive: int) -> None:
            self.reducer.some_joined = alive < self.transport.world_size
            if not divide_by_initial_world_size:
                self.reducer.divisor = alive

        state.on_alive = on_alive
        self.reducer.on_first_ready = lambda: state.announce(BACKWARD)
        try:
            for m in participants:  # may refuse (raises on every rank alike: the same model and settings)
                m.set_join_state(state)
            self._join = state
            yield
            buffers = self._module_buffers() if self.forward_sync_buffers else []
            src = state.shadow(lambda s: broadcast_tensors(self.transport, self._module_buffers(), s),
                               self.reducer.shadow_backward)
            broadcast_tensors(self.transport, self._module_params() + buffers, src)
        finally:
            for m in participants:
                m.set_join_state(None)
            self._join = None
            self.reducer.on_first_ready = None
            self.reducer.divisor = self.transport.world_size
            self.reducer.some_joined = False

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """The wrapped module's state dict: no ``module.`` prefix, loadable without DDP."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module; keys saved by torch's DDP (``module.`` prefixed) are accepted too."""
        if state_dict and all(k.startswith("module.") for k in state_dict):
            state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getstate__(self) -> dict:
        if self.process_group is not None:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with the default process "
                               "group. That is, when you have called init_process_group and have not passed "
                               "process_group argument to DDP constructor")
        if self._transport_arg is not None and not isinstance(self._transport_arg, str):
            raise RuntimeError(f"DistributedDataParallel can be pickled only with a transport named by a string "
                               f"('torch', 'shm') or chosen by default, not the object {self._transport_arg!r}")
        state = super().__getstate__()
        state.update(transport=None, reducer=None, _join=None, _mp=None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.mixed_precision is not None:
            self._mp = MixedPrecision(self.mixed_precision, self.module)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    leaves, spec = flatten(obj)
    return unflatten(spec, [fn(x) if isinstance(x, torch.Tensor) else x for _, x in leaves])


DDP = DistributedDataParallel
