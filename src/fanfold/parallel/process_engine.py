"""``DataParallel(..., engine="process")``: replica 0 in the caller, one worker process per further CPU replica
(``process_worker.py``) sharing the module's memory; ``Remote`` joins the workers' outputs to the caller's graph and
sums their gradients in replica order. Every wait is bounded (docs/data-parallel.md).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that send tensors through shared memory)
from torch import nn
from torch.autograd import Function

from .._core.shm import shared_bytes
from .._core.tree import flatten, unflatten
from .parallel_backward import _tensor, _with_tensor
from .process_worker import (
    Arena,
    Backward,
    Failure,
    Forward,
    Gradients,
    Graph,
    Mailbox,
    Outputs,
    Ready,
    Replica,
    layout,
    replica_of,
    run_backward,
    run_forward,
    unpack,
    view,
    worker_main,
)
from .replicate import replicate


def start_context(module: nn.Module) -> tuple[Any, bool]:
    # the multiprocessing context for ``module``'s workers, and whether it forks
    in_main = any(type(m).__module__ == "__main__" for m in module.modules())
    if in_main or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("fork"), True
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.multiprocessing", "fanfold"])
    return ctx, False


def structure(module: nn.Module) -> tuple[list, list[bool]]:
    """What the workers' copy of ``module`` depends on (compared at every forward), and every submodule's
    ``training`` flag."""
    sig: list = []
    training = []
    for m in module.modules():
        sig.append(type(m))
        training.append(m.training)
        sig.extend((id(t), t.data_ptr(), t.shape, t.dtype, t.requires_grad)
                   for t in chain(m._parameters.values(), m._buffers.values()) if t is not None)
    return sig, training


def stop_workers(procs: list, mailboxes: list, caller_threads: int = 0, set_to: int = 0) -> None:
    """Stop the workers (killing those that do not within seconds); give the caller ``caller_threads`` back if its
    count is still the engine's ``set_to``."""
    for m in mailboxes:
        m.stop()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)
    if caller_threads > 0 and torch.get_num_threads() == set_to != caller_threads:
        torch.set_num_threads(caller_threads)


@dataclass
class Step:
    """What ``Remote`` needs: the engine and its generation, each worker's step number, each replica's outputs' range
    and positions among the chunk inputs, replica 0's graph."""

    engine: Any
    generation: int
    steps: list[int]
    slices: list[tuple[int, int]]
    inputs: list[list[int]]
    num_chunks: int
    graph: Graph | None


class _Token:
    """Lives as long as the caller's graph node: when it goes, the workers may drop their graphs of that step."""

    def __init__(self, engine: Any, steps: list[int]) -> None:
        self.engine, self.steps = weakref.ref(engine), steps

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            for w, step in enumerate(self.steps[:len(engine.released)]):  # worker w ran step: it may drop its graph
                engine.released[w].append(step)


def _sum(local: list, replies: list[Gradients], views: list[list[torch.Tensor]]) -> list:
    """Per parameter, replica 0's gradient plus the workers', in replica order; a new tensor, or None if unused."""
    if all(g is not None and g.layout == torch.strided for g in local) and all(
            all(p is True for p in r.parameters) for r in replies):
        if not replies:
            return [g.clone() for g in local]  # autograd may hand a tensor it holds elsewhere: not ours to give away
        total = torch._foreach_add(local, views[0])
        for w in range(1, len(replies)):
            torch._foreach_add_(total, views[w])
        return total
    sums = []
    for k, g in enumerate(local):  # some replica did not use a parameter, or a gradient is sparse
        parts = [g] + [views[w][k] if r.parameters[k] is True else r.parameters[k] for w, r in enumerate(replies)]
        parts = [p for p in parts if p is not None]
        total = parts[0].clone() if len(parts) == 1 else torch.add(parts[0], parts[1]) if parts else None
        for p in parts[2:]:
            total = total + p
        sums.append(total)
    return sums


class Remote(Function):
    """``Remote.apply(step, outputs, *chunks, *params)``: see the module docstring."""

    @staticmethod
    def forward(ctx, step: Step, outputs: list, *tensors: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.step = step
        ctx.token = _Token(step.engine, step.steps)
        ctx.save_for_backward(torch.empty(0))  # so that autograd refuses a second backward without retain_graph
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        ctx.saved_tensors  # noqa: B018  (raises autograd's own error on a second backward without retain_graph)
        if torch.is_grad_enabled():
            raise RuntimeError("DataParallel(engine='process'): double backward (create_graph=True) is not "
                               "supported by the process engine; use engine='thread'")
        step, engine = ctx.step, ctx.step.engine
        if step.steps and step.generation != engine.generation:
            raise RuntimeError("DataParallel(engine='process'): the workers were stopped since this forward (close(), "
                               "a dead worker or Ctrl-C) or restarted (a structure change); run the forward again")

        def post(w: int) -> Backward:
            lo, hi = step.slices[w + 1]
            packed, grown = engine.inboxes[w].pack(list(grads[lo:hi]))
            return Backward(step.steps[w], packed, grown)

        def local() -> list:
            lo, hi = step.slices[0]
            return run_backward(step.graph, list(grads[lo:hi]))

        mine, replies = engine.exchange(len(step.steps), post, local, "backward")
        split = len(mine) - len(step.inputs[0])
        chunk_grads: list = [None] * step.num_chunks
        for pos, g in zip(step.inputs[0], mine[split:]):
            chunk_grads[pos] = g
        for w, reply in enumerate(replies):
            for pos, g in zip(step.inputs[w + 1], unpack(engine.outboxes[w], reply.inputs, copy=True)):
                chunk_grads[pos] = g
        return (None, None, *chunk_grads, *_sum(mine[:split], replies, engine.grad_views))


START_TIMEOUT = 120.0  # a forkserver's first start imports torch: slow on a loaded machine
STEP_TIMEOUT = 600.0  # one forward or backward of one replica
# a replica's exception is raised in the caller as the same type where it is one of these, else as RuntimeError
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, IndexError, KeyError, NotImplementedError)}


class WorkerDied(RuntimeError):
    """A replica's worker process ended without answering; the engine restarts its workers on the next call."""


def _replica_error(index: int, exc: Exception) -> Exception:
    kind = type(exc).__name__
    where = "run by the caller" if index == 0 else "cannot send it its arguments"
    return _ERRORS.get(kind, RuntimeError)(f"in replica {index} (engine='process', {where}): {kind}: {exc}")


class ProcessEngine:
    """The replicas of one DataParallel; ``apply`` is its ``parallel_apply``. ``close()`` stops the workers."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.generation = 0  # bumped at every start and stop: a graph of an older one cannot go backward
        self._procs: list = []  # the workers of replicas 1, 2, ...
        self._mailboxes: list[Mailbox] = []
        self._signature: list | None = None
        self._step = 0
        self.released: list[list[int]] = []  # per worker, the steps whose graph the caller has dropped
        self._finalizer: Any = None
        self._local: Replica | None = None  # replica 0, run by the caller
        self.params: list[torch.Tensor] = []  # the module's parameters that require grad
        self.inboxes: list[Arena] = []  # per worker, the caller's slot buffer (inputs, output gradients)
        self.outboxes: list[torch.Tensor] = []  # per worker, its slot buffer (outputs, input gradients)
        self.grad_views: list[list[torch.Tensor]] = []  # per worker, per parameter: its gradient slot, as a tensor

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs stop_workers once
        self._procs, self._mailboxes, self._signature, self._finalizer, self._local = [], [], None, None, None
        self.generation += 1

    def _start(self, module: nn.Module) -> None:
        self.close()
        for t in [*module.parameters(), *module.buffers()]:
            t.share_memory_()
        ctx, forked = start_context(module)
        caller_threads = torch.get_num_threads()
        threads = max(1, caller_threads // self.num_replicas)
        self.params = [p for p in module.parameters() if p.requires_grad]
        local = replica_of(replicate(module, ["cpu"])[0])  # shares the module's memory; writes its buffers (BatchNorm)
        slots, size = layout(self.params)
        workers = self.num_replicas - 1
        grads = [shared_bytes(max(size, 1)) for _ in range(workers)]
        self.grad_views = [[view(buffer, slot) for slot in slots] for buffer in grads]
        self.inboxes = [Arena() for _ in range(workers)]
        self.outboxes = [torch.empty(0, dtype=torch.uint8) for _ in range(workers)]
        self.released = [[] for _ in range(workers)]
        procs: list = []
        mailboxes: list[Mailbox] = []
        self._procs, self._mailboxes = procs, mailboxes
        self._finalizer = weakref.finalize(self, stop_workers, procs, mailboxes, caller_threads, threads)
        try:
            for w in range(workers):
                mailbox = Mailbox()
                p = ctx.Process(target=worker_main, args=(w + 1, module, mailbox.block, 1 if forked else threads,
                                                          os.getpid(), grads[w], slots),
                                name=f"fanfold-replica-{w + 1}", daemon=True)
                with warnings.catch_warnings():  # the caller's hooks stay in the caller: the workers need none
                    warnings.filterwarnings("ignore", "backward hook .* will not be serialized")
                    try:
                        p.start()
                    except Exception as exc:
                        raise RuntimeError(f"DataParallel(engine='process'): cannot send the module to the worker "
                                           f"of replica {w + 1} ({type(exc).__name__}: {exc}); its attributes must "
                                           "be picklable, or use engine='thread'") from exc
                procs.append(p)
                mailboxes.append(mailbox)
            torch.set_num_threads(threads)  # the replicas share the caller's cores
            ready = self._collect(list(range(workers)), START_TIMEOUT, "start")
            if not all(isinstance(r, Ready) for r in ready):
                raise RuntimeError(f"DataParallel(engine='process'): a worker failed to start: {ready}")
        except BaseException:
            self.close()
            raise
        self._local = local
        self._signature = structure(module)[0]
        self.generation += 1

    def _check_alive(self, what: str) -> None:
        for w, p in enumerate(self._procs):
            if not p.is_alive():
                code = p.exitcode
                self.close()
                hint = "" if what != "start" else (
                    " (its stderr says why; a script must start the engine under `if __name__ == '__main__':`, "
                    "as for any multiprocessing start method but fork)")
                raise WorkerDied(f"DataParallel(engine='process'): the worker process of replica {w + 1} died "
                                 f"{'since the last call' if what == 'call' else 'during ' + what} (exit code {code})"
                                 f"{hint}; its workers are restarted on the next call")

    def _collect(self, workers: list[int], timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        replies = []
        for w in workers:
            try:
                replies.append(self._mailboxes[w].receive(lambda: self._check_alive(what), deadline))
            except TimeoutError:
                self.close()
                raise RuntimeError(f"DataParallel(engine='process'): replica {w + 1} did not finish {what} within "
                                   f"{timeout:.0f} s; the workers were stopped") from None
        return replies

    def exchange(self, count: int, post: Callable[[int], Any], local: Callable[[], Any], what: str) -> tuple:
        """Post ``post(w)`` to workers 0..count-1 (replicas 1..count), run ``local()`` (replica 0) meanwhile, and
        collect the workers' answers: (``local()``'s result, answers). A replica's exception is raised here, naming
        it (replica 0's first); Ctrl-C stops the workers, which may be mid-step."""
        posted, failed, mine = [], None, None
        try:
            for w in range(count):
                try:
                    self._mailboxes[w].send(post(w))
                except Exception as exc:  # an argument that cannot be pickled: the posted ones must still answer
                    self.inboxes[w] = Arena()  # it may have grown unsent: the next step sends a fresh one
                    failed = (w + 1, exc)
                    break
                posted.append(w)
            if failed is None:
                try:
                    mine = local()
                except Exception as exc:
                    failed = (0, exc)
            replies = self._collect(posted, STEP_TIMEOUT, what)
        except KeyboardInterrupt:
            self.close()
            raise
        for w, reply in enumerate(replies):  # first every new buffer, also where another replica failed
            if getattr(reply, "arena", None) is not None:
                self.outboxes[w] = reply.arena
        if failed is not None:
            raise _replica_error(*failed) from failed[1]
        for reply in replies:
            if isinstance(reply, Failure):
                message = (f"in replica {reply.index} (engine='process'): {reply.kind}: {reply.message}\n\n"
                           f"Traceback in the worker process:\n{reply.traceback}")
                raise _ERRORS.get(reply.kind, RuntimeError)(message)
        return mine, replies

    def apply(self, module: nn.Module, inputs: Sequence[tuple], kwargs: Sequence[dict]) -> list:
        """``parallel_apply`` for the processes: one output per chunk, joined to the caller's graph."""
        self._check_alive("call")
        signature, training = structure(module)
        if self._local is None or signature != self._signature:
            self._start(module)
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        chunks: list[torch.Tensor] = []
        positions: list[list[int]] = []
        flat_inputs = []
        for i in range(len(inputs)):
            leaves, spec = flatten((tuple(inputs[i]), dict(kwargs[i])))
            values = [v for _, v in leaves]
            wanted = [k for k, v in enumerate(values) if _tensor(v) is not None and _tensor(v).requires_grad]
            positions.append(list(range(len(chunks), len(chunks) + len(wanted))))
            chunks.extend(_tensor(values[k]) for k in wanted)
            sent = [v if _tensor(v) is None else _with_tensor(v, _tensor(v).detach()) for v in values]
            flat_inputs.append((sent, spec, wanted if grad else []))
        steps = list(range(self._step + 1, self._step + len(inputs)))
        self._step += len(steps)

        def post(w: int) -> Forward:
            sent, spec, wanted = flat_inputs[w + 1]
            packed, grown = self.inboxes[w].pack(sent)
            release, self.released[w] = self.released[w], []
            return Forward(steps[w], packed, spec, wanted, grad, training, release, grown)

        def local() -> tuple:
            sent, spec, wanted = flat_inputs[0]
            return run_forward(self._local, sent, spec, wanted, grad, training)

        (values, spec, graph), replies = self.exchange(len(steps), post, local, "forward")
        outputs: list[tuple[list, Any]] = [([v if _tensor(v) is None else _with_tensor(v, _tensor(v).detach())
                                             for v in values], spec)]
        reply: Outputs
        for w, reply in enumerate(replies):
            outputs.append((unpack(self.outboxes[w], reply.leaves, copy=True), reply.spec))
        flat, slices = [], []
        for leaves, _ in outputs:
            lo = len(flat)
            flat.extend(t for t in (_tensor(v) for v in leaves) if t is not None)
            slices.append((lo, len(flat)))
        if grad and (chunks or self.params):
            step = Step(self, self.generation, steps, slices, positions, len(chunks), graph)
            joined = iter(Remote.apply(step, flat, *chunks, *self.params))
        else:
            joined = iter(flat)
        return [unflatten(spec, [v if _tensor(v) is None else _with_tensor(v, next(joined)) for v in leaves])
                for leaves, spec in outputs]
