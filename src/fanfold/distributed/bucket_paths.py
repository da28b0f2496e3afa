"""How one bucket is reduced: the built-in hooks by the transport straight from ``.grad`` (``reduce_tensors``), any
other hook on the flat bucket (``GradBucket``); the wait that brings each result back, and its write into ``.grad``.

Layers: ``bucket_layout <- bucket_paths <- reducer``; the transport is ``collectives.Transport`` (how it reduces the
gradients -- peer reads, shared memory, a flat copy of its own -- is its business), the hooks ``comm_hooks.py``.
The path is chosen from settings only (hook, ``gradient_as_bucket_view``, dtypes), so it is the same on every rank,
and once per change of those settings rather than in every parameter's hook.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .bucket_layout import BucketLayout
from .comm_hooks import Future, GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["BucketPaths", "BUILT_IN", "SMALL_TENSOR_BYTES"]

# The hooks whose result the reducer can have a transport compute straight into .grad: hook -> compression dtype
BUILT_IN = {allreduce_hook: None, bf16_compress_hook: torch.bfloat16, fp16_compress_hook: torch.float16}
# Below this mean gradient size a bucket's gradients are copied into its flat tensor and back (one foreach copy
# each way) rather than handed to reduce_tensors one by one: the transport's work per tensor costs more than the
# copies (a bucket of LayerNorm weights and biases)
SMALL_TENSOR_BYTES = 16 << 10


class BucketPaths(BucketLayout):
    """The launch and the wait of each bucket; the per-step containers are reset by ``Reducer._reset``."""

    hook: Callable
    hook_state: Any
    divisor: int
    hook_registered: bool
    batched: bool
    _shadowing: bool
    _pending: set
    _in_place: set
    _temps: dict
    _futures: list
    _graph_grads: dict
    _known_grads: list | None = None

    def _choose_path(self) -> None:
        # _direct: the built-in hooks, handed to the transport as the .grad tensors themselves (reduce_tensors), no
        # bucket of ours in between. Not under gradient_as_bucket_view (.grad is the bucket) nor mixed precision
        # (gradients change dtype on their way); compression as the Protocol takes it, for float32 gradients.
        fp32 = all(p.dtype == torch.float32 for p in self.params)
        self._direct = not self.as_view and self.reduce_dtype is None and self.hook in BUILT_IN and \
            (BUILT_IN[self.hook] is None or fp32)

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> Any:
        """Every all-reduce of the reducer but the gradients' (hooks, delayed parameters, the used-bitmap)."""
        return self.transport.all_reduce(tensor, bucket, divisor)

    def set_comm_hook(self, state: Any, hook: Callable) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self.hook, self.hook_state, self.hook_registered = hook, state, True
        self._choose_path()

    @property
    def hook_divisor(self) -> int:
        """What a bucket's reduction divides by. torch's hooks divide by ``process_group.size()``, whoever has joined;
        only DDP's own reduction (no hook registered) divides by the ranks still active inside
        ``join(divide_by_initial_world_size=False)`` (``divisor``), as torch's reducer does."""
        return self.transport.world_size if self.hook_registered else self.divisor

    def _copy_in(self, i: int, p: torch.Tensor) -> None:
        self._pending.discard(i)
        view = self._views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad is not view:
            view.copy_(p.grad)
            if self.as_view:
                p.grad = view  # from now on autograd accumulates straight into the bucket

    def _grads(self, b: int) -> list[torch.Tensor]:
        """Bucket ``b``'s .grad tensors where the transport can work on them in place (contiguous, the bucket's
        dtype); else a temporary (zeros for a missing one) that the write-back hands back."""
        out = []
        for i in self.buckets[b]:
            g, view = None if self._shadowing else self.params[i].grad, self._views[i]  # joined: its .grad stays
            if g is None or g is view or not g.is_contiguous() or g.dtype != view.dtype:
                g = self._temps[i] = torch.zeros_like(view) if g is None else torch.empty_like(view).copy_(g)
            out.append(g)
        return out

    def _launch(self, b: int) -> None:
        last = b == len(self.buckets) - 1
        if self._direct and BUILT_IN[self.hook] is None and \
                self.flats[b].numel() * self.flats[b].element_size() < SMALL_TENSOR_BYTES * len(self.buckets[b]):
            self._futures[b] = self._launch_flat(b)
            return
        if self._direct:
            self._in_place.add(b)
            # Only the last bucket waits for the peers to be done with this rank's gradients (settle): every earlier
            # bucket's are by then, and nothing changes a gradient before the end of backward.
            self._futures[b] = self.transport.reduce_tensors(self._grads(b), bucket=b, divisor=self.hook_divisor,
                                                             settle=last, compress=BUILT_IN[self.hook])
            return
        for i in [i for i in self.buckets[b] if i in self._pending]:
            self._copy_in(i, self.params[i])  # batched_grad_copy: the bucket's copies, together
        members = self.buckets[b]
        bucket = GradBucket(b, self.flats[b], [self.params[i] for i in members], [self._views[i] for i in members],
                            last, self.hook_divisor, self.all_reduce, self._workspace)
        self._futures[b] = self.hook(self.hook_state, bucket)

    def _launch_flat(self, b: int) -> Future:
        """The direct path for a bucket of small gradients: into the flat bucket, all-reduced, back where they were
        (a missing one into a temporary of zeros that the write-back hands back). The same sum and division."""
        flat, members = self.flats[b], self.buckets[b]
        views = [self._views[i] for i in members]
        known = self._known_grads  # the .grad of every parameter, just read (Reducer._settle_deferred), else None
        grads = [] if self._shadowing else [self.params[i].grad for i in members] if known is None else \
            [known[i] for i in members]  # joined: its .grad stays
        if self._shadowing:
            flat.zero_()
        else:
            for k, g in enumerate(grads):
                if g is None:
                    grads[k] = self._temps[members[k]] = torch.zeros_like(views[k])
            torch._foreach_copy_(views, grads)
        work = self.transport.all_reduce(flat, b, self.hook_divisor)

        def finish() -> None:
            work.wait()
            if grads:
                torch._foreach_copy_(grads, views)

        return Future(finish)

    def _wait_all(self) -> None:
        for b, fut in enumerate(self._futures):
            if fut is None:
                continue  # skipped (skip_all_reduce_unused_params)
            result = fut.wait()
            if self._direct:
                continue  # the results are in .grad (or the temporaries) already
            if isinstance(result, (list, tuple)):  # a torch future of a c10d work yields [tensor]
                result = result[0]
            if isinstance(result, torch.Tensor) and result is not self.flats[b]:
                self.flats[b].copy_(result.reshape(-1))

    def _write_back(self, used: list[float] | None, sparse: dict[int, torch.Tensor]) -> None:
        """The averages into ``.grad``: ``used[i]`` ranks used parameter i (None: all); ``sparse``: the averaged
        sparse gradients by parameter."""
        if self._direct and used is None and not sparse and not self._temps and not self._graph_grads:
            return  # every .grad holds its average already
        for i, p in enumerate(self.params):
            if used is not None and used[i] == 0:
                continue  # no rank used it: leave .grad as a single process would (None)
            view, temp = self._views[i], self._temps.get(i)
            if self.sparse[i]:
                p.grad = sparse[i].to(p.dtype)
            elif self._direct:  # .grad holds the average already, unless it had none usable: then a fresh tensor does
                if temp is not None:
                    p.grad = temp if p.grad is None else p.grad.copy_(temp)
            elif self.as_view:
                p.grad = view
            elif p.grad is None or p.grad.dtype != p.dtype:  # mixed precision: back to the parameter's dtype
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)
        with torch.enable_grad():
            for i, g in self._graph_grads.items():  # differentiable in this rank's own gradient, value unchanged
                p = self.params[i]
                p.grad = (g - g.detach()) + p.grad
