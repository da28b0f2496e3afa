"""The gradient reducer: per-parameter hooks mark gradients ready, full buckets are reduced in bucket order on every
rank, and the end of backward writes the averages into ``.grad``; readiness, sparse and delayed gradients too."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch

from ..collectives.protocol import Transport
from .comm_hooks import Future, GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["GradientStrategy", "Reducer", "ShardsGradients", "BUILT_IN", "SMALL_TENSOR_BYTES", "MiB", "bucket_caps",
           "assign_buckets", "rebuild_order"]

# The hooks the transport runs itself: hook -> compression dtype
BUILT_IN = {allreduce_hook: None, bf16_compress_hook: torch.bfloat16, fp16_compress_hook: torch.float16}
# Below this mean gradient size a bucket goes through its flat tensor: the transport's work per tensor costs more
SMALL_TENSOR_BYTES = 16 << 10
MiB = 1024 * 1024


class GradientStrategy(Protocol):
    """Where the averaged gradients go instead of ``.grad`` (ZeRO stage 2): it reduces each bucket from its parameters'
    ``.grad`` with the reducer's transport and hook; the reducer decides when, in the same order on every rank."""

    def launch(self, bucket: int) -> None:
        """The ``.grad`` of ``reducer.buckets[bucket]``'s parameters are final (None: zeros): start its reduction."""

    def finish(self) -> None:
        """Wait for every reduction launched."""

    def write_back(self, used: list[float] | None) -> None:
        """The end of a synchronised backward without error: ``used[i]`` ranks used parameter i (None: all did)."""


@runtime_checkable
class ShardsGradients(Protocol):
    """An optimizer (``fanfold.ZeroRedundancyOptimizer``) stepping the gradients where its own strategy leaves them."""

    def gradient_strategy(self, reducer: Reducer) -> GradientStrategy:
        """Lay the optimizer out after ``reducer``'s buckets (collective; may refuse); the strategy to hand them to."""


def _mib(name: str, value: Any, shown: Any) -> int:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number of MiB, got {shown!r}")
    return max(1, int(value * MiB))


def bucket_caps(bucket_cap_mb: float | None = None, first_bucket_cap_mb: float | None = None,
                bucket_cap_mb_list: Sequence[float] | None = None) -> list[int]:
    """Bucket caps in bytes (a dtype's k-th bucket: ``caps[k]``, the last after); default 1 MiB, then 25 MiB."""
    if bucket_cap_mb_list is not None:
        if first_bucket_cap_mb is not None:
            raise ValueError("DistributedDataParallel: first_bucket_cap_mb and bucket_cap_mb_list both set the first "
                             "bucket's cap; give one")
        if isinstance(bucket_cap_mb_list, (str, bytes)) or not isinstance(bucket_cap_mb_list, Sequence) or \
                not bucket_cap_mb_list:
            raise ValueError(f"bucket_cap_mb_list must be a non-empty list of MiB figures, got {bucket_cap_mb_list!r}")
        return [_mib("each of bucket_cap_mb_list", mb, bucket_cap_mb_list) for mb in bucket_cap_mb_list]
    cap = _mib("bucket_cap_mb", 25.0 if bucket_cap_mb is None else bucket_cap_mb, bucket_cap_mb)
    first = _mib("first_bucket_cap_mb", 1.0 if first_bucket_cap_mb is None else first_bucket_cap_mb,
                 first_bucket_cap_mb)
    return [min(first, cap), cap]


def assign_buckets(nbytes: Sequence[int], keys: Sequence[Hashable], caps: Sequence[int],
                   order: Sequence[int] | None = None) -> list[list[int]]:
    """Group parameter indices into buckets that never mix ``keys``, filled in ``order`` (default: reverse), a key's
    k-th bucket closing at ``caps[k]`` bytes; sorted by the position of each bucket's first member in ``order``."""
    order = list(range(len(nbytes) - 1, -1, -1)) if order is None else list(order)
    open_: dict[Hashable, tuple[list[int], int]] = {}  # key -> (indices, bytes) of the bucket being filled
    closed: dict[Hashable, int] = {}  # key -> number of its buckets closed so far
    done: list[list[int]] = []
    for i in order:
        members, size = open_.pop(keys[i], ([], 0))
        members.append(i)
        size += nbytes[i]
        k = closed.get(keys[i], 0)
        if size >= caps[min(k, len(caps) - 1)]:
            done.append(members)
            closed[keys[i]] = k + 1
        else:
            open_[keys[i]] = (members, size)
    done.extend(members for members, _ in open_.values())
    position = {i: p for p, i in enumerate(order)}
    done.sort(key=lambda members: position[members[0]])
    return done


def rebuild_order(ready: Sequence[int], n: int) -> list[int]:
    """A full gradient-ready order from the indices seen ready in one backward; the others last, in reverse."""
    seen = set(ready)
    return [*ready, *(i for i in range(n - 1, -1, -1) if i not in seen)]


# torch's words for a reduction a backward left unfinished (raised at the next forward), which torch's tests match
_UNFINISHED = "Expected to have finished reduction in the prior iteration before starting a new one. "
_UNUSED = ("This error indicates that your module has parameters that were not used in producing loss. You can enable "
           "unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
           "`torch.nn.parallel.DistributedDataParallel`, and by making sure all `forward` function outputs participate "
           "in calculating loss (or set requires_grad=False on parameters you never train).")
_STATIC = ("This error indicates that your training graph has changed in this iteration, e.g., one parameter is used "
           "in first iteration, but then got unused in the second iteration. this is not compatible with static_graph "
           "set to True.")


def unfinished_message(rank: int, indices: list[int], names: list[str], static: bool = False,
                       detail: str = "") -> str:
    """torch's error of the forward after a backward whose reduction could not finish, naming the parameters."""
    return (f"DistributedDataParallel (rank {rank}): {_UNFINISHED}{_STATIC if static else _UNUSED}\n"
            f"Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, indices))}\n"
            f"Parameters which did not receive grad for rank {rank}: {', '.join(names)}{detail}\n"
            "(fanfold names them whatever the environment says; torch's DDP asks you to set the environment "
            "variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to see them.) That backward left every "
            ".grad as this rank computed it, un-averaged, as torch's DDP does; no forward with grad runs until this "
            "DistributedDataParallel is built again.")


def _all_gather_varlen(transport: Transport, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` by rank (any length along dim 0): zero-padded tables only their owner fills, summed."""
    counts = torch.zeros(transport.world_size, dtype=torch.int64, device=tensor.device)
    counts[transport.rank] = tensor.shape[0]
    transport.all_reduce(counts).wait()
    lengths = counts.tolist()
    table = torch.zeros((transport.world_size, max(lengths), *tensor.shape[1:]), dtype=tensor.dtype,
                        device=tensor.device)
    table[transport.rank, : tensor.shape[0]] = tensor
    transport.all_reduce(table).wait()
    return [table[r, :n] for r, n in enumerate(lengths)]


def all_reduce_sparse(transport: Transport, grad: torch.Tensor, divisor: float) -> torch.Tensor:
    """The sum over ranks of the sparse ``grad`` / ``divisor``, from the rows in rank order: the same on every rank."""
    grad = grad.coalesce()
    indices = _all_gather_varlen(transport, grad.indices().t().contiguous())
    values = _all_gather_varlen(transport, grad.values().contiguous())
    total = torch.sparse_coo_tensor(torch.cat(indices).t(), torch.cat(values), grad.shape,
                                    check_invariants=False).coalesce()
    return torch.sparse_coo_tensor(total.indices(), total.values().div_(divisor), grad.shape,
                                   is_coalesced=True, check_invariants=False)


class Reducer:
    """Bucketed, overlapped gradient averaging for ``params`` over ``transport`` (``caps``: see ``bucket_caps``);
    ``reduce_dtype``: the buckets' dtype; ``delayed``: averaged at the end of backward, outside the buckets."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], names: Sequence[str], transport: Transport, caps: Sequence[int],
        find_unused_parameters: bool, gradient_as_bucket_view: bool, *, static_graph: bool, sparse: Sequence[bool],
        reduce_dtype: torch.dtype | None, skip_unused: bool, delayed: Sequence[torch.nn.Parameter],
    ):
        self.params, self.names, self.delayed, self.sparse = list(params), list(names), list(delayed), list(sparse)
        self.transport, self.rank, self.caps, self.reduce_dtype = transport, transport.rank, list(caps), reduce_dtype
        self.all_reduce = transport.all_reduce  # what GradBucket.all_reduce issues
        self.find_unused, self.as_view, self.skip_unused = find_unused_parameters, gradient_as_bucket_view, skip_unused
        self.divisor = transport.world_size
        self.hook, self.hook_state = allreduce_hook, None
        self.hook_registered = False  # by DDP.register_comm_hook: the hook divides by the world size (hook_divisor)
        self.expect_sync = False  # the backward of the last forward synchronises
        self.on_first_ready: Callable[[], None] | None = None  # DDP's join announcement, before any bucket launch
        self.params_back: Callable[[], None] | None = None  # mixed precision: masters back after each backward
        # static_graph: a parameter is ready after as many hooks as in the first synchronised backward (only counted)
        self.static, self.expected = static_graph, None  # expected: hooks per parameter in that first backward
        self._static_used: list[float] | None = None  # static graph: which parameters some rank used, once
        # join(): some rank has joined (set on every rank at each exchange): the first iteration's count is stale
        self.some_joined = False
        self._shadowing = False
        self._double = False  # this backward differentiates the gradients of a create_graph one: averaged too
        self._used = [False] * len(self.params)  # got a gradient since the last synchronisation (no_sync included)
        self._device = (self.params or self.delayed or [torch.zeros(0)])[0].device
        self._sparse_ids = [i for i, s in enumerate(self.sparse) if s]
        self.strategy: GradientStrategy | None = None
        # optimizers in backward: None until DDP's first forward looks for them, as torch's does
        self.in_backward: list[int] | None = None
        self.unfinished: str | None = None  # torch's error for every later forward with grad
        self.rebuilt = False  # buckets rebuilt, once, in rank 0's gradient-ready order
        self._build(None)
        self._reset()
        ref = weakref.ref(self)  # the parameters must not keep a discarded reducer alive
        for i, p in [*enumerate(self.params), *((None, p) for p in self.delayed)]:
            handle = p.register_post_accumulate_grad_hook(partial(Reducer._on_ready, ref, i))
            weakref.finalize(self, handle.remove)  # the hooks leave with the reducer

    def _reset(self) -> None:
        self._temps: dict[int, torch.Tensor] = {}  # reduce_tensors' tensors for parameters without a usable .grad
        self._graph_grads: dict[int, torch.Tensor] = {}  # create_graph: this rank's differentiable gradients
        self._copied: list[tuple[list, list]] = []  # (.grad tensors, their views) copied into the flat buckets
        self._gaps = False  # a bucket was launched with a parameter whose .grad was None (zeros in its place)
        self.ready = [False] * len(self.params)
        self.counts = [0] * len(self.params)
        self.order: list[int] = []
        self._left = [len(m) for m in self.buckets]
        self._next = 0
        self._futures: list[Any] = [None] * len(self.buckets)
        self._queued = self._touched = self._announced = False  # end of backward queued; a hook fired; join announced
        self._error: BaseException | None = None

    def prepare_for_forward(self, sync: bool) -> None:
        if self._queued or self._touched:
            self._reset()  # a backward that raised midway never ran its end of backward
        self._double = False
        self.expect_sync = sync and bool(self.params or self.delayed)

    def use_strategy(self, make: Callable[[Reducer], GradientStrategy], who: str) -> None:
        """From now on the buckets (frozen; the reducer's own dropped) go to the strategy ``make(self)`` returns
        (collective; ``make`` may refuse by raising); ``who`` names the caller in the errors."""
        why = ("mixed_precision (the reduction dtype differs from the parameters')" if self.reduce_dtype else
               "gradient_as_bucket_view=True (there are no full buckets to view)" if self.as_view else
               "sparse gradients (nn.Embedding(sparse=True))" if any(self.sparse) else
               "delay_all_reduce_named_params" if self.delayed else
               "a backward in progress" if self._queued or self._touched else None)
        if why:
            raise ValueError(f"{who} (rank {self.transport.rank}): not supported with {why}")
        self.strategy = make(self)
        self.rebuilt = True
        self.flats = [torch.empty(f.numel(), dtype=f.dtype, device="meta") for f in self.flats]
        self._views = [None if v is None else torch.empty(v.shape, dtype=v.dtype, device="meta") for v in self._views]
        self._bucket_views = [[self._views[i] for i in m] for m in self.buckets]

    def backward_started(self) -> None:
        """The backward reached DDP's outputs (or a parameter): queue the end of backward in this outermost pass."""
        if self._queued or not (self.expect_sync or self.params_back is not None):
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def begin_backward(self) -> bool:
        """Queue the end of backward and make join's announcement, once; whether this backward synchronises."""
        self.backward_started()
        if self.expect_sync and self._error is None and not self._announced:
            self._announced = True
            if self.on_first_ready is not None:
                self.on_first_ready()
        return self.expect_sync

    @staticmethod
    def _on_ready(ref: weakref.ref, i: int | None, p: torch.Tensor) -> None:
        """Parameter ``i``'s gradient hook (None: a delayed parameter's), with the reducer ``ref()``. It runs once per
        parameter and step (800 times on benchmarks/small_params.py's model), hence one Python frame and the few
        calls: see docs/benchmarks.md, 2026-11-27."""
        self = ref()
        if self is None:
            return
        g = p.grad
        if i is not None and g is not None:
            # the hook also fires for an undefined gradient: a parameter no rank has a gradient for keeps grad=None
            self._used[i] = True
        first, self._touched = not self._touched, True
        # join's announcement (once) comes before any bucket, so it may raise here; once made (which implies a
        # synchronising backward with its end queued) begin_backward has nothing left to do in this backward
        if not (self._announced or self.begin_backward()) or self._error is not None:
            return  # no_sync(), or a backward through the module outside DDP.forward: plain local accumulation
        try:
            if first and self.static and not self.counting and not self._double:
                for k in self.static_unused:
                    self._mark(k)  # a static graph's unused parameters are ready from the start
                    self._take(k, self.params[k].grad)
            if i is None or (self.static and not self._double and not self._count(i)):
                return  # a static graph's parameter short of its count of hooks is not ready yet
            if self.ready[i]:
                raise RuntimeError(
                    f"DistributedDataParallel (rank {self.rank}): Expected to mark a variable ready only once: "
                    f"parameter {self.names[i]!r} has been marked as ready twice (it got a second gradient in this "
                    "backward, after its bucket could already be reduced). Typical causes: a block checkpointed with "
                    "use_reentrant=True whose parameters are also used outside it, or a block checkpointed twice; a "
                    "parameter used outside forward. Pass static_graph=True to DistributedDataParallel if the model "
                    "uses the same parameters the same number of times in every iteration, or checkpoint with "
                    "use_reentrant=False.")
            self.ready[i] = True  # _mark, inline (this path runs for every parameter of every step)
            self.order.append(i)
            self._take(i, g)
        except Exception as exc:  # raised by the end of backward, once the peers have all their collectives
            self._fail(exc)

    @property
    def counting(self) -> bool:  # the first synchronised backward of a static graph: reduce nothing until its end
        return self.static and self.expected is None

    @property
    def static_unused(self) -> list[int]:
        return [] if self.expected is None else [i for i, c in enumerate(self.expected) if c == 0]

    def _count(self, i: int) -> bool:
        """A static graph's parameter ``i``'s hook fired: whether it is ready by its count (never while counting)."""
        self.counts[i] += 1
        if self.expected is None:  # counting
            if self.counts[i] == 1:
                self.order.append(i)  # the first-seen order: what the buckets are rebuilt from
            return False
        if self.counts[i] > self.expected[i]:  # torch raises in the backward, with these words
            was = "unused" if self.expected[i] == 0 else "used fewer times"
            raise RuntimeError(
                f"DistributedDataParallel (rank {self.rank}): Your training graph has changed in this iteration, "
                f"e.g., one parameter is {was} in first iteration, but then got used in the second iteration. "
                f"this is not compatible with static_graph set to True. (static_graph=True: parameter "
                f"{self.names[i]!r} got {self.counts[i]} gradient(s) where the first iteration gave it "
                f"{self.expected[i]}. A parameter unused in the first iteration must stay unused, and a used one "
                "must be used the same number of times; pass static_graph=False, with find_unused_parameters=True "
                "if some parameters go unused.)")
        return self.counts[i] == self.expected[i]

    def _mark(self, i: int) -> None:
        self.ready[i] = True
        self.order.append(i)

    def _learn(self) -> None:  # the end of the first synchronised backward of a static graph
        self.expected = list(self.counts)

    def _short(self) -> list[int]:  # fewer hooks than the static graph expects
        return [] if self.expected is None else [i for i, (c, e) in enumerate(zip(self.counts, self.expected)) if c < e]

    def _changed_message(self, indices: list[int]) -> str:
        detail = "; ".join(f"{self.names[i]!r} got {self.counts[i]} gradient(s) where the first iteration gave it "
                           f"{self.expected[i]}" for i in indices)
        return unfinished_message(self.rank, indices, [self.names[i] for i in indices], static=True,
                                  detail=f" ({detail}). Pass static_graph=False (with find_unused_parameters=True "
                                         "if some parameters go unused).")

    def _end_of_backward(self) -> None:
        self._queued = self._announced = False
        if not self._touched:
            return  # no parameter reached: a later backward of the same forward still synchronises
        self._touched = False
        try:
            if self.expect_sync:
                self._finalize()
        finally:
            if self.params_back is not None:
                self.params_back()

    def _take(self, i: int, g: torch.Tensor | None) -> None:
        """Parameter ``i`` is ready with gradient ``g`` (its ``.grad``): one fewer in its bucket to wait for."""
        if g is not None and (g.requires_grad or g.is_sparse != self.sparse[i]):
            self._own_grad(i, self.params[i])
        b = self._bucket_of[i]  # None: sparse, reduced at the end of backward
        if b is not None:
            left = self._left
            left[b] -= 1
            if not left[b]:
                self._launch_ready()

    def _own_grad(self, i: int, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if g.requires_grad:  # create_graph: reduce a plain copy, keep the differentiable one for the write-back
            self._graph_grads[i] = g
            p.grad = g = g.detach().clone()
        if g.is_sparse != self.sparse[i]:
            kind = "a sparse" if g.is_sparse else "a dense"
            self._fail(RuntimeError(
                f"DistributedDataParallel (rank {self.transport.rank}): parameter {self.names[i]!r} got {kind} "
                "gradient, but only the weight of an nn.Embedding or nn.EmbeddingBag built with sparse=True is "
                "reduced as sparse (and always is): use one for sparse gradients, or sparse=False."))
            p.grad = g.to_dense() if g.is_sparse else g.to_sparse(1)

    def _fail(self, exc: BaseException) -> None:
        self._error = self._error or exc

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            if not self._skipped(self._next):
                (self._launch if self.strategy is None else self.strategy.launch)(self._next)
            self._next += 1

    def _skipped(self, b: int) -> bool:
        # skip_all_reduce_unused_params (torch's contract: the same unused parameters on every rank): a bucket none
        # of whose parameters got a gradient is not reduced; a static graph knows it from the first iteration.
        if not self.skip_unused or self._shadowing or self._double:
            return False
        unused = set(self.static_unused) if self.static else \
            {i for i, u in enumerate(self._used) if not u} if self.find_unused else set()
        return all(i in unused for i in self.buckets[b])

    def _finalize(self) -> None:
        double, arm = self._double, bool(self._graph_grads)
        counting = self.counting and not double
        if counting:
            self._learn()
        missing = [] if all(self.ready) else [i for i, ready in enumerate(self.ready) if not ready]
        # Where torch's reducer cannot finish (a parameter without gradient and no find_unused_parameters; a static
        # graph's parameter short of its count), .grad is this rank's own and the next forward raises. The collectives
        # still go out, with zeros, so that no peer is left waiting.
        short = self._short() if not double else []
        if short:
            self.unfinished = self._changed_message(short)
        elif missing and not (self.find_unused or self.static or double):
            self.unfinished = unfinished_message(self.transport.rank, missing, [self.names[i] for i in missing])
        keep = self._keep_local() if self.unfinished is not None else None
        try:
            for i in missing:  # contribute what the parameter holds (no_sync accumulation) or zeros
                self._own_grad(i, self.params[i])
                if not self.sparse[i]:
                    self._left[self._bucket_of[i]] = 0
            used, sparse = self._reduce_rest(counting)
            if self.params_back is not None:
                self.params_back()
            if self.strategy is not None and self._graph_grads:
                self._fail(RuntimeError(
                    f"DistributedDataParallel (rank {self.transport.rank}): backward(create_graph=True) is not "
                    "supported with sharded gradients (shard_gradients): the full gradients are freed"))
            if keep is not None:
                if self._error is None and self.strategy is None:
                    self._restore_local(keep)
            elif self._error is None:  # the strategy seam: ZeRO stage 2 keeps this rank's parts, .grad stays None
                self._write_back(used, sparse) if self.strategy is None else self.strategy.write_back(used)
                if self.in_backward:
                    self._step_in_backward()
        finally:
            error = self._error
            self._end_step()
        # create_graph: the backward of these gradients (a gradient penalty) is averaged too, as the one-process
        # gradient of the averaged gradient requires; a new forward cancels it
        self.expect_sync = self._double = arm and error is None
        if error is not None:
            raise error

    def _reduce_rest(self, counting: bool) -> tuple[list[float] | None, dict[int, torch.Tensor]]:
        """Launch the buckets left, reduce the delayed and sparse gradients, wait: (``used``, sparse averages)."""
        self._launch_ready()
        used = self._used_everywhere(counting)
        delayed = self._reduce_delayed()
        sparse = {i: self._reduce_sparse(k, i) for k, i in enumerate(self._sparse_ids)}
        (self._wait_all if self.strategy is None else self.strategy.finish)()
        delayed()
        return used, sparse

    def _keep_local(self) -> dict[int, torch.Tensor]:
        # not those already reduced where .grad is (under gradient_as_bucket_view torch's are averaged too)
        keep = {}
        for b, members in enumerate(self.buckets):
            if b < self._next and (self.as_view or self._in_grad[b]):
                continue
            for i in members:
                g = self.params[i].grad
                if g is not None:
                    keep[i] = g.detach().clone()
        return keep

    def _restore_local(self, keep: dict[int, torch.Tensor]) -> None:
        # as torch leaves .grad: this rank's own (as a bucket view: divided by the world size, but under a comm hook)
        for i, g in keep.items():
            p = self.params[i]
            if self.as_view and self.ready[i]:
                p.grad = self._views[i].copy_(g if self.hook_registered else g / self.divisor)
            elif p.grad is None or p.grad.shape != g.shape:
                p.grad = g
            else:
                p.grad.detach().copy_(g)

    def _step_in_backward(self) -> None:
        # One no rank used steps on zeros (torch's hook has them from the bucket), but not as a bucket view or skipped
        for i in self.in_backward:
            p = self.params[i]
            if self.sparse[i] or self._futures[self._bucket_of[i]] is not None:
                if p.grad is None and not self.as_view:
                    p.grad = torch.zeros_like(p)
                for opt in p._in_backward_optimizers:
                    opt.step()
            p.grad = None

    def _used_everywhere(self, counting: bool) -> list[float] | None:
        """Per parameter, how many ranks used it since the last synchronisation (None: all used, not asked)."""
        # With find_unused_parameters a parameter none of the active ranks used keeps .grad None, as in one process;
        # the first iteration's count may name a rank that has joined since, so under join() it is asked again.
        if self.static and not counting and not self._double and not (self.find_unused and self.some_joined):
            return self._static_used
        if not (self.find_unused or counting or self._double):
            return None
        used = torch.tensor(self._used, dtype=torch.float32, device=self._device)
        self.all_reduce(used).wait()
        used = used.tolist()
        if counting:
            self._static_used = used
        return used

    def _reduce_delayed(self) -> Callable[[], None]:
        """One flat all-reduce of the delayed gradients (divided by the world size, in join() too, as torch's); returns
        the wait and write-back."""
        params, shadow = self.delayed, self._shadowing
        if not params:
            return lambda: None
        dtype = self.reduce_dtype or params[0].dtype
        flat = torch.cat([torch.zeros(p.numel(), dtype=dtype, device=p.device) if p.grad is None or shadow
                          else p.grad.detach().reshape(-1).to(dtype) for p in params])
        handle = self.all_reduce(flat, None, self.transport.world_size)

        def write_back() -> None:
            handle.wait()
            for p, avg in zip(() if shadow else params, flat.split([p.numel() for p in params])):
                avg = avg.view_as(p)
                p.grad = avg.to(p.dtype, copy=True) if p.grad is None else p.grad.detach().copy_(avg)

        return write_back

    def _reduce_sparse(self, k: int, i: int) -> torch.Tensor | None:
        # As torch's: a bucket of its own after the dense ones, the gradient itself a hook's buffer(); None if it raised
        p = self.params[i]
        grad = p.grad if p.grad is not None and not self._shadowing else torch.sparse_coo_tensor(
            torch.zeros(1, 0, dtype=torch.int64, device=p.device),
            torch.zeros(0, *p.shape[1:], dtype=p.dtype, device=p.device), p.shape, check_invariants=False)
        grad = grad.to(self.reduce_dtype or grad.dtype)
        if not self.hook_registered:
            return all_reduce_sparse(self.transport, grad, self.hook_divisor)
        bucket = GradBucket(len(self.buckets) + k, grad, [p], [grad], False, self.hook_divisor, self._issue_sparse)
        try:
            result = self.hook(self.hook_state, bucket).wait()
        except Exception as exc:  # noqa: BLE001 -- the hook's error (fp16 on the CPU), raised at the end
            self._fail(exc)
            return None
        return result[0] if isinstance(result, (list, tuple)) else result  # a torch future yields [tensor]

    def _issue_sparse(self, tensor: torch.Tensor, bucket: int, divisor: float | None) -> Future:
        """``GradBucket.all_reduce`` of a sparse bucket: the sum into ``tensor`` in place, as torch's does."""
        if not tensor.is_sparse:
            return self.all_reduce(tensor, bucket, divisor)
        tensor.copy_(all_reduce_sparse(self.transport, tensor, 1 if divisor is None else divisor))
        return Future(lambda: None)

    def _end_step(self) -> None:
        self._rebuild(self.order)
        self._used = [False] * len(self.params)
        self._reset()
        self.expect_sync = False

    def shadow_backward(self) -> None:
        """Issue the collectives of one synchronised backward with zero gradients (a rank that has joined)."""
        for flat in self.flats:
            flat.zero_()
        counting = self.counting
        if counting:
            self._learn()
        self._shadowing = True
        self._left, self._used = [0] * len(self.buckets), [False] * len(self.params)
        try:
            self._reduce_rest(counting)
        finally:
            self._shadowing = False
        self._end_step()

    def _build(self, order: list[int] | None) -> None:
        ps, dtype = self.params, lambda p: self.reduce_dtype or p.dtype
        order = [i for i in (range(len(ps) - 1, -1, -1) if order is None else order) if not self.sparse[i]]
        groups = assign_buckets([p.numel() * dtype(p).itemsize for p in ps], [(dtype(p), p.device) for p in ps],
                                self.caps, order)
        old_views = getattr(self, "_views", None)
        self.buckets, self._views, self._bucket_of = groups, [None] * len(ps), [None] * len(ps)
        self.flats = [torch.empty(sum(ps[i].numel() for i in m), dtype=dtype(ps[m[0]]), device="meta") for m in groups]
        self._choose_path()
        for b, members in enumerate(groups):
            # a bucket reduced where .grad is holds no data: its views only give the shapes (no memory taken)
            if not self._in_grad[b]:
                self.flats[b] = torch.zeros_like(self.flats[b], device=ps[members[0]].device)
            flat = self.flats[b]
            for i, view in zip(members, flat.split([ps[i].numel() for i in members])):
                self._views[i] = view.view(ps[i].shape)
                self._bucket_of[i] = b
        self._bucket_views = [[self._views[i] for i in m] for m in groups]  # _launch's lists, made once
        if self.as_view and old_views is not None:
            for i, p in enumerate(ps):  # keep .grad a view into the (new) bucket
                if p.grad is not None and p.grad is old_views[i]:
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]

    def _rebuild(self, ready_order: list[int]) -> None:
        """Adopt rank 0's observed gradient-ready order, once, so that every rank builds the same buckets."""
        if self.rebuilt:
            return
        order = torch.tensor(rebuild_order(ready_order, len(self.params)), dtype=torch.float32)
        self.transport.broadcast(order, 0)
        self.rebuilt = True
        new = [int(i) for i in order.tolist()]
        current = [i for members in self.buckets for i in members]
        if [i for i in new if not self.sparse[i]] != current or not self._direct:
            self._build(new)  # a hook's buckets move into the transport's memory

    def _choose_path(self) -> None:
        # From settings and sizes only, so the same on every rank (docs/ddp.md, "Each bucket's path")
        compress = self._compress = BUILT_IN.get(self.hook)
        self._builtin = self.hook in BUILT_IN and (compress is None or
                                                   all(f.dtype == torch.float32 for f in self.flats))
        self._direct = self._builtin and not self.as_view and self.reduce_dtype is None
        self._in_grad = [self._direct and (compress is not None or
                                           f.numel() * f.element_size() >= SMALL_TENSOR_BYTES * len(m))
                         for f, m in zip(self.flats, self.buckets)]

    def set_comm_hook(self, state: Any, hook: Callable) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self.hook, self.hook_state, self.hook_registered = hook, state, True
        self._build([i for members in self.buckets for i in members])  # the hook's buckets need their memory

    @property
    def hook_divisor(self) -> int:
        # torch's hooks divide by the group's size; its own reduction by the ranks active in join() (self.divisor)
        return self.transport.world_size if self.hook_registered else self.divisor

    def _grads(self, b: int) -> list[torch.Tensor]:
        """Bucket ``b``'s .grad tensors, or a temporary where unusable in place (the write-back hands it back)."""
        out = []
        for i in self.buckets[b]:
            g, view = None if self._shadowing else self.params[i].grad, self._views[i]  # joined: its .grad stays
            if g is None or not g.is_contiguous() or g.dtype != view.dtype:
                temp = torch.empty(view.shape, dtype=view.dtype, device=self._device)
                g = self._temps[i] = temp.zero_() if g is None else temp.copy_(g)
            out.append(g)
        return out

    def _launch(self, b: int) -> None:
        last, flat, members, compress = b == len(self.buckets) - 1, self.flats[b], self.buckets[b], self._compress
        if self._in_grad[b]:
            # only the last bucket settles: the earlier ones' peers are done by then, and no gradient changes before
            self._futures[b] = self.transport.reduce_tensors(self._grads(b), bucket=b, divisor=self.hook_divisor,
                                                             settle=last, compress=compress)
            return
        if not self._shadowing:  # joined: the bucket holds zeros, its .grad stays
            # Outside gradient_as_bucket_view a .grad is never a view of the bucket: with every gradient there, the
            # bucket's views and its .grad tensors are the two lists of one foreach copy, no loop in Python.
            views, grads = self._bucket_views[b], [self.params[i].grad for i in members]
            if self.as_view or any(g is None for g in grads):
                pairs = []
                for i, view, g in zip(members, views, grads):
                    if g is None:
                        view.zero_()
                        self._gaps = True
                    elif g is not view:
                        pairs.append((view, g))
                        if self.as_view:
                            self.params[i].grad = view  # from now on autograd accumulates straight into the bucket
                views, grads = [v for v, _ in pairs], [g for _, g in pairs]
            if views:
                torch._foreach_copy_(views, grads)
                if not self.as_view and self.reduce_dtype is None:
                    self._copied.append((grads, views))  # the averages go back into these .grad tensors
        if not self._builtin:
            bucket = GradBucket(b, flat, [self.params[i] for i in members], [self._views[i] for i in members],
                                last, self.hook_divisor, self.all_reduce)
            self._futures[b] = self.hook(self.hook_state, bucket)
        elif compress is None:
            self._futures[b] = self.transport.all_reduce(flat, b, self.hook_divisor)
        else:
            self._futures[b] = self.transport.reduce_tensors([flat], b, divisor=self.hook_divisor, compress=compress)

    def _wait_all(self) -> None:
        for b, fut in enumerate(self._futures):
            if fut is None:
                continue  # skipped (skip_all_reduce_unused_params)
            result = fut.wait()
            if self._builtin:
                continue  # the results are where they were reduced
            if isinstance(result, (list, tuple)):  # a torch future of a c10d work yields [tensor]
                result = result[0]
            if isinstance(result, torch.Tensor) and result is not self.flats[b]:
                self.flats[b].copy_(result.reshape(-1))

    def _write_back(self, used: list[float] | None, sparse: dict[int, torch.Tensor]) -> None:
        """The averages into ``.grad``: ``used[i]`` ranks used parameter i (None: all)."""
        for grads, views in self._copied:
            torch._foreach_copy_(grads, views)
        # Every .grad holds its average already (the ordinary step): the loop below would change nothing, at a
        # Python iteration per parameter (autograd keeps a .grad in its parameter's dtype).
        settled = used is None and not (sparse or self._temps or self.as_view or self.reduce_dtype is not None or
                                        self._gaps)
        for i, p in enumerate(() if settled else self.params):
            if used is not None and used[i] == 0:
                continue  # no rank used it: leave .grad as a single process would (None)
            temp = self._temps.get(i)
            if self.sparse[i]:
                p.grad = sparse[i].to(p.dtype)
            elif temp is not None:  # reduced where .grad is, which had no usable tensor
                p.grad = temp if p.grad is None else p.grad.copy_(temp)
            elif self.as_view:
                p.grad = self._views[i]
            elif p.grad is None or p.grad.dtype != p.dtype:
                p.grad = self._views[i].to(p.dtype, copy=True)
            elif self.reduce_dtype is not None:  # mixed precision: the masters' .grad, full precision again
                p.grad.copy_(self._views[i])
        with torch.enable_grad():
            for i, g in self._graph_grads.items():  # differentiable in this rank's own gradient, value unchanged
                p = self.params[i]
                p.grad = (g - g.detach()) + p.grad
