"""ZeRO stage 2's parameter gather after the optimizer's step, overlapped with the next forward.

The trainable parameters become views of one flat tensor per DDP bucket (laid out as ``BucketShard`` says), so each
bucket is one all-gather straight into the parameters, all in flight at once. Until a bucket's gather is waited for,
:class:`_PendingReads` (a ``TorchFunctionMode``) makes every read of its memory wait for it; the model's forward ends
by waiting for all. Where reads cannot be seen, ``step()`` waits and says so once (docs/zero.md).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..collectives.protocol import Transport

__all__ = ["ParamGather"]

# Tensor attributes and methods that read metadata only: no wait (zero_grad reads p.grad of every parameter).
_META = frozenset(
    [getattr(torch.Tensor, a).__get__ for a in ("grad", "shape", "dtype", "device", "requires_grad", "is_leaf",
                                                "grad_fn", "layout", "is_sparse", "ndim", "_version", "is_cuda")]
    + [torch.Tensor.grad.__set__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
       torch.Tensor.is_contiguous, torch.Tensor.stride, torch.Tensor.element_size, torch.Tensor.requires_grad_,
       torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook])


class _PendingReads(TorchFunctionMode):
    """Waits for the bucket of any tensor argument that lies in a bucket whose gather is in flight. It holds the
    gathers' handles, not the :class:`ParamGather`: reads still wait once the optimizer and the wrapper are
    collected with gathers in flight (the transport living on, e.g. the fanfold backend's)."""

    def __init__(self, gather: ParamGather):
        super().__init__()
        self.pending, self.storage = gather.pending, gather.storage

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.pending and func not in _META:
            for a in (*args, *(kwargs or {}).values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.Tensor):
                        _wait_for(self.pending, self.storage, t)
        return func(*args, **(kwargs or {}))


def _pop_idle_modes() -> None:
    """Pop every :class:`_PendingReads` on top of this thread's stack whose gathers are all done (or gone): a mode
    cannot pop itself while it runs, and a mode under another one must stay until that one is popped."""
    while (n := torch._C._len_torch_function_stack()) > 0:
        top = torch._C._get_function_stack_at(n - 1)
        if not isinstance(top, _PendingReads) or top.pending:
            return
        torch._C._pop_torch_function_stack()


def _settle(pending: dict) -> None:
    while pending:
        pending.pop(next(iter(pending))).wait()


def _wait_for(pending: dict, storage: dict, t: torch.Tensor) -> None:
    """Wait for the gather of the bucket ``t`` lies in (``storage``: bucket by storage address), if in flight."""
    try:
        b = storage.get(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors: not a bucket
        return
    if b is not None and b in pending:
        for done in list(pending):  # earlier ones first: the transports complete them in order
            pending.pop(done).wait()
            if done == b:
                break


def _wait_all(ref: weakref.ref, *_: Any) -> None:
    gather = ref()
    if gather is not None:
        gather.wait_all()


class ParamGather:
    """The parameters of ``layout``'s buckets laid flat, and their gather (issue, per-bucket waits)."""

    def __init__(self, layout: list, params: list[torch.Tensor], transport: Transport,
                 module: torch.nn.Module | None):
        self.layout, self.transport = layout, transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.flats: list[torch.Tensor] = []
        with torch.no_grad():
            for s in layout:
                flat = torch.zeros(s.chunk * self.world_size, dtype=s.dtype, device=s.device)
                for k, i in enumerate(s.members):
                    view = flat[s.offsets[k]:s.offsets[k] + s.numels[k]]
                    view.copy_(params[i].detach().reshape(-1))
                    params[i].data = view.view(params[i].shape)  # the Parameter object, its hooks and .grad stay
                self.flats.append(flat)
        self.storage = {f.untyped_storage().data_ptr(): b for b, f in enumerate(self.flats)}
        # The forward reads the parameters roughly in registration order; DDP's buckets hold them in reverse.
        self.order = sorted(range(len(layout)), key=lambda b: min(layout[b].members))
        self.pending: dict[int, Any] = {}  # bucket -> handle of its gather, in issue order
        self._announced: set[str] = set()
        scripted = module is not None and any(isinstance(m, torch.jit.ScriptModule) for m in module.modules())
        self.why_not = "the model holds TorchScript modules, whose reads of the parameters cannot be seen" \
            if scripted else None
        self._hooks = []
        if module is not None:
            ref = weakref.ref(self)
            self._hooks.append(module.register_forward_hook(lambda *a: _wait_all(ref)))
            self._hooks += [m.register_state_dict_pre_hook(lambda *a: _wait_all(ref)) for m in module.modules()]
            weakref.finalize(self, lambda hooks: [h.remove() for h in hooks], self._hooks)

    def _announce(self, why: str) -> None:
        if why not in self._announced:
            self._announced.add(why)
            warnings.warn(f"fanfold ZeRO stage 2 (rank {self.rank}): the parameter gather after step() is not "
                          f"overlapped with the next forward, step() waits for it: {why}", stacklevel=4)

    @torch.no_grad()
    def issue(self) -> None:
        """Start gathering every bucket (collective); with the mode pushed, return with the gathers in flight."""
        self.wait_all()  # also pops the modes left by earlier gathers (this one's or another model's)
        if self.world_size == 1:
            return
        for b in self.order:
            s, flat = self.layout[b], self.flats[b]
            self.pending[b] = self.transport.all_gather(flat[self.rank * s.chunk:][:s.chunk], flat, b)
        why = self.why_not or (None if torch._C._len_torch_function_stack() == 0 else
                               "another TorchFunctionMode is active when step() returns")
        if why is not None:
            self._announce(why)
            self.wait_all()
            return
        torch._C._push_on_torch_function_stack(_PendingReads(self))

    def wait_all(self) -> None:
        """Wait for every gather in flight; pop the modes that have nothing left to wait for."""
        _settle(self.pending)
        _pop_idle_modes()
