"""DistributedDataParallel: one process per replica, gradients averaged by fanfold's bucketed reducer.

Top of ``env <- buckets <- reducer <- ddp``. Construction checks that every rank holds the same model (a fixed-size
digest exchange first, the details only on a mismatch, so a wrong model fails in seconds instead of hanging a
broadcast), broadcasts parameters and buffers from rank 0 and hooks the reducer onto the parameters. Forward
re-syncs buffers from rank 0 and tells the reducer whether the coming backward synchronises (not under
``no_sync()``). ``join()`` lets ranks with fewer batches shadow the others (``join.py``). Every collective goes
through the transport (``transport.py``): shared memory when every rank shares this host (``shm.py``), else
torch.distributed, or anything with the same methods.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .._utils import normalize_device
from .join import BACKWARD, FORWARD, JoinState
from .participants import DDPParticipant
from .reducer import Reducer
from .stall import inspected
from .transport import all_gather_bytes, all_gather_rows, resolve_transport

__all__ = ["DistributedDataParallel", "DDP"]

# torch's keywords that fanfold accepts but does not implement, with the value that means "off".
_NOT_IMPLEMENTED = {
    "static_graph": False, "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None,
    "mixed_precision": None, "device_mesh": None, "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None, "batched_grad_copy": False, "check_reduction": False,
}
_BROADCAST_BYTES = 64 * 1024 * 1024


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` (already on this process's device) for data-parallel training over a process group.

    Takes torch's keywords (those not implemented warn and are ignored) plus ``transport`` ("torch", "shm" or a
    transport object; default ``$FANFOLD_TRANSPORT``, else ``select_transport``: "shm" when every rank shares this
    host and its CPU, "torch" otherwise), ``first_bucket_cap_mb`` (1 MiB) and ``stall_timeout`` (seconds a collective
    may wait before ``StallError`` names the ranks that never arrived; default ``$FANFOLD_STALL_TIMEOUT`` or 300).
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
        given = dict(static_graph=static_graph, delay_all_reduce_named_params=delay_all_reduce_named_params,
                     param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                     device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                     bucket_cap_mb_list=bucket_cap_mb_list, batched_grad_copy=batched_grad_copy,
                     check_reduction=check_reduction)
        for name, value in given.items():
            if value is not _NOT_IMPLEMENTED[name] and value != _NOT_IMPLEMENTED[name]:
                warnings.warn(f"DistributedDataParallel: {name}={value!r} is not implemented by fanfold and is "
                              "ignored", stacklevel=2)
        self.module = module
        self.dim = dim
        self.device_ids, self.output_device = self._check_devices(module, device_ids, output_device)
        self.broadcast_buffers = bool(forward_sync_buffers if forward_sync_buffers is not None
                                      else broadcast_buffers if broadcast_buffers is not None else True)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.require_backward_grad_sync = True
        self.process_group = process_group
        # Every collective is numbered and its wait bounded by the stall inspector (stall.py).
        self.transport = inspected(resolve_transport(transport, process_group), stall_timeout)
        named = list(module.named_parameters())
        self._check_same_model(module)
        if init_sync:
            self._broadcast([p for _, p in named] + self._module_buffers(), 0)
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], self.transport, bucket_cap_mb,
                               first_bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view)
        self._join: JoinState | None = None
        for m in module.modules():  # SyncBatchNorm: its collectives may share DDP's transport
            if isinstance(m, DDPParticipant):
                m.use_transport(self.transport, process_group)

    # ---- construction ---------------------------------------------------------------------------------------
    @staticmethod
    def _check_devices(module: nn.Module, device_ids: list | None, output_device: Any) -> tuple:
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

    def _check_same_model(self, module: nn.Module) -> None:
        """Fail on every rank, naming the first differing parameter and the ranks, when the models differ."""
        t = self.transport
        entries = [f"parameter {n!r} shape {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
                   for n, p in module.named_parameters()]
        entries += [f"buffer {n!r} shape {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
        digest = hashlib.sha256("\n".join(entries).encode()).digest()[:16]
        rows = all_gather_rows(t, torch.tensor(list(digest), dtype=torch.float32))
        differ = [r for r in range(t.world_size) if not torch.equal(rows[r], rows[0])]
        if not differ:
            return
        lists = [json.loads(b) for b in all_gather_bytes(t, json.dumps(entries).encode())]
        r = differ[0]
        k = next((k for k, (a, b) in enumerate(zip(lists[0], lists[r])) if a != b), min(len(lists[0]), len(lists[r])))
        mine = lists[0][k] if k < len(lists[0]) else "nothing (its model ends there)"
        theirs = lists[r][k] if k < len(lists[r]) else "nothing (its model ends there)"
        raise RuntimeError(
            f"DistributedDataParallel (rank {t.rank}): the model differs between ranks {[0] + differ}: at entry {k} "
            f"rank 0 has {mine} but rank {r} has {theirs}. Every rank must build the same model (same code, "
            "arguments and checkpoint) before wrapping it."
        )

    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast ``tensors`` in place from ``src``: flat tensors of one (dtype, device) and at most 64 MiB,
        so that a large model is not copied whole."""
        groups: dict[tuple, list[list[torch.Tensor]]] = {}
        for tensor in tensors:
            chunks = groups.setdefault((tensor.dtype, tensor.device), [[]])
            if chunks[-1] and sum(x.numel() * x.element_size() for x in chunks[-1]) >= _BROADCAST_BYTES:
                chunks.append([])
            chunks[-1].append(tensor)
        with torch.no_grad():
            for chunk in (c for chunks in groups.values() for c in chunks):
                flat = torch.cat([x.reshape(-1) for x in chunk])
                self.transport.broadcast(flat, src)
                offset = 0
                for x in chunk:
                    x.copy_(flat[offset: offset + x.numel()].view_as(x))
                    offset += x.numel()

    def _module_buffers(self) -> list[torch.Tensor]:
        return list(self.module.buffers())  # looked up each time: .to() or load_state_dict(assign=True) replace them

    # ---- training step --------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Buffers are re-synced at the first forward after a backward only: a second forward before the backward
        # (GANs) must not write in place into buffers that the first forward saved for backward (pytorch#22095).
        buffers = self._module_buffers() if self.broadcast_buffers and self.reducer.backward_seen else []
        src = 0
        if self._join is not None:
            _, src = self._join.announce(FORWARD, bool(buffers))
        if buffers:
            self._broadcast(buffers, src)
        self.reducer.backward_seen = False
        self.reducer.prepare_for_forward(torch.is_grad_enabled() and self.require_backward_grad_sync)
        if self.device_ids and self.device_ids[0].type != "cpu":
            inputs, kwargs = _to_device((inputs, kwargs), self.device_ids[0])
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients locally; the next synchronised backward
        averages the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> future`` (see ``comm_hooks``)."""
        self.reducer.set_comm_hook(state, hook)

    @contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Train on uneven inputs: a rank that leaves the block shadows the others' collectives until all leave;
        then every rank takes the parameters of the last rank still training."""
        if not enable:
            yield
            return
        if self._join is not None:
            raise RuntimeError("DistributedDataParallel.join() contexts cannot be nested")
        state = JoinState(self.transport, divide_by_initial_world_size, throw_on_early_termination)
        state.begin_backward = self.reducer.begin_backward
        participants = [m for m in self.module.modules() if isinstance(m, DDPParticipant)]

        def announce_backward() -> None:
            alive, _ = state.announce(BACKWARD)
            if not divide_by_initial_world_size:
                self.reducer.divisor = alive

        def shadow_backward(alive: int) -> None:
            if not divide_by_initial_world_size:
                self.reducer.divisor = alive
            self.reducer.shadow_backward()

        self.reducer.on_first_ready = announce_backward
        try:
            for m in participants:  # may refuse (raises on every rank alike: the same model and settings)
                m.set_join_state(state)
            self._join = state
            yield
            self._join = None
            self.reducer.on_first_ready = None
            src = state.shadow(lambda s: self._broadcast(self._module_buffers(), s), shadow_backward)
            self._broadcast(list(self.module.parameters()) + self._module_buffers(), src)
        finally:
            for m in participants:
                m.set_join_state(None)
            self._join = None
            self.reducer.on_first_ready = None
            self.reducer.divisor = self.transport.world_size

    # ---- module plumbing ------------------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        """The wrapped module's state dict: no ``module.`` prefix, loadable without DDP."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module; keys saved by torch's DDP (``module.`` prefixed) are accepted too."""
        if state_dict and all(k.startswith("module.") for k in state_dict):
            state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


DDP = DistributedDataParallel
