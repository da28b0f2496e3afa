"""The gradient reducer: per-parameter hooks fill flat buckets, each bucket's all-reduce starts as soon as it is
full, and the end of backward waits, averages and writes the gradients back.

Third layer of ``env <- buckets <- reducer <- ddp``; every collective goes through a transport (``transport.py``).

Ordering is the whole game across ranks: collectives match by issue order, so buckets are launched strictly in
bucket order on every rank -- a bucket that fills early waits until all buckets before it have been launched.
After the first synchronised backward the buckets are rebuilt from the order in which gradients actually became
ready, and rank 0's order is broadcast so that every rank builds the same buckets.

The end of backward (a callback queued on the autograd engine by the first hook of a backward) launches what is
left, waits for every bucket in order and writes the averaged gradients back -- unless the transport already wrote
them into ``.grad`` (the default hook, ``.grad`` not a bucket view, the shm transport: ``reduce_tensors`` sums the
``.grad`` tensors where they are, without filling the bucket at all; else ``reduce_into``). A parameter
that got no gradient either contributes zeros (``find_unused_parameters=True``; a bitmap all-reduce tells whether
some rank used it, and a parameter no rank used keeps ``grad=None`` as in one process) or makes every bucket still
launch before a RuntimeError names it, so the peers are not left waiting on a collective that never comes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from .buckets import assign_buckets, bucket_caps, rebuild_order
from .comm_hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .transport import issue_all_reduce

__all__ = ["Reducer"]

# The hooks whose result the reducer can have a transport compute straight into .grad: hook -> compression dtype
_BUILT_IN = {allreduce_hook: None, bf16_compress_hook: torch.bfloat16, fp16_compress_hook: torch.float16}


class Reducer:
    """Bucketed, overlapped gradient averaging for ``params`` (those requiring grad) over ``transport``."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        transport: Any,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ):
        pairs = [(p, n) for p, n in zip(params, names) if p.requires_grad]
        self.params = [p for p, _ in pairs]
        self._fp32 = all(p.dtype == torch.float32 for p in self.params)  # what the compressing transports take
        self.names = [n for _, n in pairs]
        self.transport = transport
        self.all_reduce = functools.partial(issue_all_reduce, transport)  # every all-reduce of the reducer
        self.first_cap, self.cap = bucket_caps(bucket_cap_mb, first_bucket_cap_mb)
        self.find_unused = bool(find_unused_parameters)
        self.as_view = bool(gradient_as_bucket_view)
        self.divisor = transport.world_size
        self.hook: Callable = allreduce_hook
        self.hook_state: Any = None
        self.expect_sync = False  # set by DDP.forward when the backward of this forward must synchronise
        self.backward_seen = False  # a hook fired since DDP last looked (buffers may be re-synced safely)
        self.on_first_ready: Callable[[], None] | None = None  # DDP's join announcement, before any bucket launch
        self.rebuilt = False
        self._shadowing = False
        self.last_ready_order: list[int] = []
        self._used = [False] * len(self.params)  # got a gradient since the last synchronisation (no_sync included)
        self._choose_path()
        self._build(None)
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ---- bucket layout -------------------------------------------------------------------------------------
    def _build(self, order: list[int] | None) -> None:
        ps = self.params
        groups = assign_buckets([p.numel() * p.element_size() for p in ps], [(p.dtype, p.device) for p in ps],
                                self.cap, self.first_cap, order)
        old_views = getattr(self, "_views", None)
        self.buckets, self.flats, self._views, self._loc = groups, [], [None] * len(ps), [None] * len(ps)
        self._workspaces: dict[tuple, torch.Tensor] = {}
        for b, members in enumerate(groups):
            flat = self._bucket_memory(sum(ps[i].numel() for i in members), ps[members[0]].dtype,
                                       ps[members[0]].device)
            offset = 0
            for i in members:
                n = ps[i].numel()
                self._views[i] = flat[offset: offset + n].view(ps[i].shape)
                self._loc[i] = (b, offset, n)
                offset += n
            self.flats.append(flat)
        if self.as_view and old_views is not None:
            for i, p in enumerate(ps):  # keep .grad a view into the (new) bucket
                if p.grad is not None and p.grad is old_views[i]:
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]

    def _bucket_memory(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # A transport that offers memory its peers can read (ShmTransport.allocate) all-reduces a bucket there
        # in place, without copying it into its own buffers. Taken once, for the buckets rebuilt after the first
        # backward, as every rank rebuilds the same buckets at the same point (allocate is collective).
        take = self.rebuilt and device.type == "cpu" and not self._direct  # direct: buckets never hold data
        allocate = getattr(self.transport, "allocate", None) if take else None
        flat = allocate(numel, dtype) if callable(allocate) else None
        return flat if flat is not None else torch.zeros(numel, dtype=dtype, device=device)

    def _workspace(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Bucket ``b``'s scratch tensor of ``dtype`` (a compression hook's narrow copy), kept across steps. Every
        rank's hooks ask for the same ones in bucket order, so taking it from the transport stays collective."""
        key = (b, dtype)
        if key not in self._workspaces:
            flat = self.flats[b]
            self._workspaces[key] = self._bucket_memory(flat.numel(), dtype, flat.device)
        return self._workspaces[key]

    def _choose_path(self) -> None:
        # Settings only (hook, gradient_as_bucket_view, dtypes, transport), so the same on every rank; decided here
        # once rather than in every parameter's hook. _direct: the built-in hooks on a transport that all-reduces
        # the gradients where autograd left them (ShmTransport reading its peers' memory): no copy into the bucket
        # at all; the compression hooks' bits come from rounding where the values are read. _into: the default
        # hook on a transport that writes a bucket's average straight into .grad.
        t, hook, fp32 = self.transport, self.hook, self._fp32
        self._direct = hook in _BUILT_IN and not self.as_view and (_BUILT_IN[hook] is None or fp32) and \
            bool(getattr(t, "supports_reduce_tensors", False))
        self._into = hook is allreduce_hook and not self.as_view and bool(getattr(t, "supports_reduce_into", False))

    def _reset(self) -> None:
        self._temps: dict[int, torch.Tensor] = {}  # reduce_into's outputs for parameters without a usable .grad
        self._ready = [False] * len(self.params)
        self._order: list[int] = []
        self._left = [len(m) for m in self.buckets]
        self._next = 0
        self._futures: list[Any] = [None] * len(self.buckets)
        self._queued = False

    def prepare_for_forward(self, sync: bool) -> None:
        """Called by DDP.forward: whether the coming backward synchronises. A backward that raised midway never
        ran its end-of-backward callback; its half-filled state is dropped here so the next one starts clean."""
        if self._queued:
            self._reset()
        self.expect_sync = sync and bool(self.params)

    # ---- during backward -----------------------------------------------------------------------------------
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_ready(i, param)

        return hook

    def _on_ready(self, i: int, p: torch.Tensor) -> None:
        self.backward_seen = True
        self._used[i] = True
        if not self.expect_sync:
            return  # no_sync(), or a backward through the module outside DDP.forward: plain local accumulation
        self.begin_backward()
        if self._ready[i]:
            return
        if not self._direct:
            self._copy_in(i, p)
        self._ready[i] = True
        self._order.append(i)
        b = self._loc[i][0]
        self._left[b] -= 1
        if self._left[b] == 0:
            self._launch_ready()

    def begin_backward(self) -> bool:
        """Start a synchronised backward, once: queue the end-of-backward callback, make DDP's join announcement.
        Run by the first gradient hook, or before that by a module whose backward issues collectives of its own
        (fanfold.SyncBatchNorm under join()), which must follow the announcement. Whether this backward
        synchronises."""
        if self.expect_sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            if self.on_first_ready is not None:
                self.on_first_ready()
        return self.expect_sync

    def _copy_in(self, i: int, p: torch.Tensor) -> None:
        view = self._views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad is not view:
            view.copy_(p.grad)
            if self.as_view:
                p.grad = view  # from now on autograd accumulates straight into the bucket

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _grads(self, b: int, fresh: Callable[[torch.Tensor, Any], torch.Tensor]) -> list[torch.Tensor]:
        """Bucket ``b``'s .grad tensors where a transport can work on them in place (contiguous, the bucket's dtype,
        CPU, not a bucket view); else ``fresh(view, grad)``, a temporary that _finalize hands back."""
        out = []
        for i in self.buckets[b]:
            g, view = None if self._shadowing else self.params[i].grad, self._views[i]  # joined: its .grad stays
            if g is None or g is view or not g.is_contiguous() or g.dtype != view.dtype or g.device.type != "cpu":
                g = self._temps[i] = fresh(view, g)
            out.append(g)
        return out

    def _launch(self, b: int) -> None:
        # The same choice of path on every rank: it depends on settings only, never on this rank's gradients.
        if self._direct:
            # Each .grad is all-reduced where it is (a parameter without one contributes zeros). Only the last
            # bucket waits for the peers to finish reading this rank's gradients: every earlier bucket's readers
            # are done by then, and nothing changes a gradient before the end of backward.
            tensors = self._grads(b, lambda v, g: torch.zeros_like(v) if g is None else torch.empty_like(v).copy_(g))
            narrow = _BUILT_IN[self.hook]
            self._futures[b] = self.transport.reduce_tensors(tensors, bucket=b, divisor=self.divisor,
                                                             settle=b == len(self.buckets) - 1,
                                                             **({} if narrow is None else {"compress": narrow}))
        elif self._into:  # the bucket (copied in) is averaged straight into .grad: nothing copied out at the end
            outs = self._grads(b, lambda v, g: torch.empty_like(v))
            self._futures[b] = self.transport.reduce_into(self.flats[b], outs, bucket=b, divisor=self.divisor)
        else:
            members = self.buckets[b]
            bucket = GradBucket(b, self.flats[b], [self.params[i] for i in members],
                                [self._views[i] for i in members], b == len(self.buckets) - 1, self.divisor,
                                self.all_reduce, self._workspace)
            self._futures[b] = self.hook(self.hook_state, bucket)

    # ---- end of backward ------------------------------------------------------------------------------------
    def _finalize(self) -> None:
        self.last_ready_order = list(self._order)  # this rank's, for inspection; rank 0's decides the rebuild
        missing = [i for i, r in enumerate(self._ready) if not r]
        for i in missing:  # contribute what the parameter holds (no_sync accumulation) or zeros
            if not self._direct:
                self._copy_in(i, self.params[i])
            self._left[self._loc[i][0]] = 0
        self._launch_ready()
        if missing and not self.find_unused:
            self._wait_all()  # peers must not wait for buckets this rank never launched
            self._end_step()
            raise RuntimeError(self._unused_message(missing))
        used = None
        if self.find_unused:
            used = torch.tensor(self._used, dtype=torch.float32, device=self.flats[0].device)
            self.all_reduce(used).wait()
            used = used.tolist()
        self._wait_all()
        into = self._into or self._direct
        for i, p in enumerate(self.params):
            if used is not None and used[i] == 0:
                continue  # no rank used it: leave .grad as a single process would (None)
            view, temp = self._views[i], self._temps.get(i)
            if into:  # .grad holds the average already, unless it had none usable: then a fresh tensor does
                if temp is not None:
                    p.grad = temp if p.grad is None else p.grad.copy_(temp)
            elif self.as_view:
                p.grad = view
            else:
                p.grad = view.clone() if p.grad is None else p.grad.copy_(view)
        self._end_step()

    def _end_step(self) -> None:
        if not self.rebuilt:
            self._rebuild()
        self._used = [False] * len(self.params)
        self._reset()
        self.expect_sync = False

    def _wait_all(self) -> None:
        for b, fut in enumerate(self._futures):
            result = fut.wait()
            if self._direct:
                continue  # the results are in .grad (or the temporaries) already
            if isinstance(result, (list, tuple)):  # a torch future of a c10d work yields [tensor]
                result = result[0]
            if isinstance(result, torch.Tensor) and result is not self.flats[b]:
                self.flats[b].copy_(result.reshape(-1))

    def _rebuild(self) -> None:
        """Adopt rank 0's observed gradient-ready order, once, so that every rank builds the same buckets."""
        order = torch.tensor(rebuild_order(self._order, len(self.params)), dtype=torch.float32)
        self.transport.broadcast(order, 0)
        self.rebuilt = True
        new = [int(i) for i in order.tolist()]
        if new != [i for members in self.buckets for i in members] or callable(getattr(self.transport, "allocate",
                                                                                           None)):
            self._build(new)

    def _unused_message(self, missing: list[int]) -> str:
        names = [self.names[i] for i in missing]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        return (f"DistributedDataParallel (rank {self.transport.rank}): {len(names)} parameter(s) got no gradient in "
                f"this backward: {shown}. Every parameter that requires grad must take part in the loss on every "
                "rank, or pass find_unused_parameters=True to DistributedDataParallel (or set requires_grad=False on "
                "parameters you never train).")

    # ---- join: mirror a step this rank does not take ---------------------------------------------------------
    def shadow_backward(self) -> None:
        """Issue the collectives of one synchronised backward with zero gradients (a rank that has joined)."""
        for flat in self.flats:
            flat.zero_()
        self._shadowing = True
        try:
            for b in range(len(self.buckets)):
                self._launch(b)
        finally:
            self._shadowing = False
        if self.find_unused:
            self.all_reduce(torch.zeros(len(self.params), dtype=torch.float32, device=self.flats[0].device)).wait()
        self._wait_all()
        if not self.rebuilt:
            self._rebuild()
        self._reset()

    def set_comm_hook(self, state: Any, hook: Callable) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self.hook, self.hook_state = hook, state
        self._choose_path()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
