"""ProcessEngine: ``DataParallel(..., engine="process")``'s replicas, one persistent worker process each (CPU).

Threads running CPU replicas serialise on the interpreter lock for small operations; processes do not. The engine
starts its workers on first use (``process_worker.worker_main``) after moving the user's parameters and buffers into
shared memory in place (``share_memory_()``): the optimizer keeps stepping the same tensors and every worker sees
them. The workers are restarted when the module's structure changes (a parameter or buffer replaced, moved, re-typed
or its ``requires_grad`` flipped), after a worker died, and after Ctrl-C.

The caller scatters the batch (``DataParallel.scatter``), copies each worker's chunk into that worker's shared slot
buffer and sends it a small header (``process_slots``: no tensor is pickled per step), and reads the outputs back
from the worker's buffer. One autograd Function, ``_Remote``, joins them to the caller's graph: its inputs are the
chunks that require grad and the parameters that do, its outputs the workers' outputs. Its backward writes the
gradients of each worker's outputs into its slots; the workers differentiate concurrently and write parameter
gradients into their gradient slots, which the caller sums in replica order and hands to autograd, so ``.grad``
accumulates (or is created) exactly as for the bare module and parameter hooks run once.

Threads: the workers share the caller's intra-op threads (``torch.get_num_threads() // replicas`` each; one where
they are forked, which cannot use the OpenMP threads their parent has used), and the caller runs one until
``close()``: its idle OpenMP threads would otherwise spin after each of its small operations on the workers' cores.
Every wait is bounded and polls the workers: a dead worker is an error within a second or so, never a hang.
Layer: ``process_worker`` / ``process_start`` <- ``process_engine`` <- ``data_parallel``.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that send tensors through shared memory)
from torch import nn
from torch.autograd import Function

from .._core.tree import flatten, unflatten
from .parallel_backward import _tensor, _with_tensor
from .process_slots import Arena, layout, shared_bytes, unpack, view
from .process_start import start_context, stop_workers, structure
from .process_worker import Backward, Failure, Forward, Gradients, Outputs, Ready, worker_main

START_TIMEOUT = 120.0  # a forkserver's first start imports torch: slow on a loaded machine
STEP_TIMEOUT = 600.0  # one forward or backward of one replica
# a replica's exception is raised in the caller as the same type where it is one of these, else as RuntimeError
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, IndexError, KeyError, NotImplementedError)}


class WorkerDied(RuntimeError):
    """A replica's worker process ended without answering; the engine restarts its workers on the next call."""


@dataclass
class _Step:
    """What ``_Remote`` needs: the engine, each replica's step number and its outputs' range."""

    engine: ProcessEngine
    steps: list[int]
    slices: list[tuple[int, int]]
    inputs: list[list[int]]  # per replica, positions among the Function's chunk inputs
    num_chunks: int


class _Token:
    """Lives as long as the caller's graph node: when it goes, the workers may drop their graphs of that step."""

    def __init__(self, engine: ProcessEngine, steps: list[int]) -> None:
        self.engine, self.steps = weakref.ref(engine), steps

    def __del__(self) -> None:
        engine = self.engine()
        if engine is not None:
            engine._released.extend(self.steps)


class _Remote(Function):
    @staticmethod
    def forward(ctx, step: _Step, outputs: list, *tensors: torch.Tensor) -> tuple:
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
        if len(engine._procs) < len(step.steps):
            raise RuntimeError("DataParallel(engine='process'): the workers were stopped since this forward (close(), "
                               "a dead worker or Ctrl-C); run the forward again")
        msgs = []
        for i, (s, (lo, hi)) in enumerate(zip(step.steps, step.slices)):
            packed, grown = engine._inboxes[i].pack(list(grads[lo:hi]))
            msgs.append(Backward(s, packed, grown))
        replies: list[Gradients] = engine._exchange(msgs)
        chunk_grads: list = [None] * step.num_chunks
        for i, (reply, positions) in enumerate(zip(replies, step.inputs)):
            for pos, g in zip(positions, unpack(engine._outboxes[i], reply.inputs, copy=True)):
                chunk_grads[pos] = g
        sums: list = []
        for k in range(len(engine._grad_slots)):
            total = None
            for i, reply in enumerate(replies):  # replica order: the same sum every step
                if reply.parameters[k]:
                    g = engine._grad_views[i][k]
                    total = g.clone() if total is None else total.add_(g)
            sums.append(total)
        return (None, None, *chunk_grads, *sums)


class ProcessEngine:
    """The worker processes of one DataParallel; ``apply`` is its ``parallel_apply``. ``close()`` stops them."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._procs: list = []
        self._conns: list = []
        self._signature: list | None = None
        self._step = 0
        self._released: list[int] = []
        self._finalizer: Any = None
        self._inboxes: list[Arena] = []  # per worker, the caller's slot buffer (inputs, output gradients)
        self._outboxes: list[torch.Tensor] = []  # per worker, its slot buffer (outputs, input gradients)
        self._grads: list[torch.Tensor] = []  # per worker, its parameter gradients' buffer
        self._grad_slots: list = []  # where each parameter that requires grad lies in those buffers
        self._grad_views: list[list[torch.Tensor]] = []  # per worker, per parameter: its slot, as a tensor

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs stop_workers once
        self._procs, self._conns, self._signature, self._finalizer = [], [], None, None

    def _start(self, module: nn.Module) -> None:
        self.close()
        for t in [*module.parameters(), *module.buffers()]:
            t.share_memory_()
        ctx, forked = start_context(module)
        n = self.num_replicas
        threads = 1 if forked else max(1, torch.get_num_threads() // n)
        procs, conns = [], []
        self._grad_slots, size = layout([p for p in module.parameters() if p.requires_grad])
        self._grads = [shared_bytes(max(size, 1)) for _ in range(n)]
        self._grad_views = [[view(buffer, slot) for slot in self._grad_slots] for buffer in self._grads]
        self._inboxes = [Arena() for _ in range(n)]
        self._outboxes = [torch.empty(0, dtype=torch.uint8) for _ in range(n)]
        try:
            for i in range(n):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(i, module, theirs, threads, os.getpid(), self._grads[i],
                                                          self._grad_slots),
                                name=f"fanfold-replica-{i}", daemon=True)
                with warnings.catch_warnings():  # the caller's hooks stay in the caller: the workers need none
                    warnings.filterwarnings("ignore", "backward hook .* will not be serialized")
                    try:
                        p.start()
                    except Exception as exc:
                        raise RuntimeError(f"DataParallel(engine='process'): cannot send the module to the worker "
                                           f"of replica {i} ({type(exc).__name__}: {exc}); its attributes must be "
                                           "picklable, or use engine='thread'") from exc
                theirs.close()
                procs.append(p)
                conns.append(ours)
            self._procs, self._conns = procs, conns
            self._finalizer = weakref.finalize(self, stop_workers, procs, conns, torch.get_num_threads())
            # see the module docstring: idle OpenMP threads of the caller spin on the workers' cores
            torch.set_num_threads(1)
            ready = self._receive(list(range(n)), START_TIMEOUT, "start")
            if not all(isinstance(r, Ready) for r in ready):
                raise RuntimeError(f"DataParallel(engine='process'): a worker failed to start: {ready}")
        except BaseException:
            if self._finalizer is not None:
                self._finalizer()
            else:
                stop_workers(procs, conns)
            self._procs, self._conns, self._finalizer = [], [], None
            raise
        self._signature = structure(module)

    def _receive(self, indices: list[int], timeout: float, what: str) -> list:
        """One message from each worker in ``indices``; bounded, and a dead worker is an error at once."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(indices):
            pending = [i for i in indices if i not in replies]
            ready = wait([self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending],
                         timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for i in pending:
                if self._conns[i] in ready:
                    try:
                        replies[i] = self._conns[i].recv()
                    except (EOFError, OSError):
                        pass
                if i not in replies and not self._procs[i].is_alive():
                    code = self._procs[i].exitcode
                    self.close()
                    hint = "" if what != "start" else (
                        " (its stderr says why; a script must start the engine under `if __name__ == '__main__':`, "
                        "as for any multiprocessing start method but fork)")
                    raise WorkerDied(f"DataParallel(engine='process'): the worker process of replica {i} died "
                                     f"during {what} (exit code {code}){hint}; its workers are restarted on the "
                                     "next call")
            if len(replies) < len(indices) and time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"DataParallel(engine='process'): replicas {pending} did not finish {what} "
                                   f"within {timeout:.0f} s; the workers were stopped")
        return [replies[i] for i in indices]

    def _exchange(self, msgs: list) -> list:
        """Send ``msgs[i]`` to worker i, gather the answers; a Failure is raised as the replica's exception."""
        try:
            for conn, msg in zip(self._conns, msgs):
                conn.send(msg)
            replies = self._receive(list(range(len(msgs))), STEP_TIMEOUT, type(msgs[0]).__name__.lower())
        except KeyboardInterrupt:
            self.close()  # the workers may be mid-step: stop them; the next call starts fresh ones
            raise
        for i, reply in enumerate(replies):  # first every new buffer, also where another replica failed
            if getattr(reply, "arena", None) is not None:
                self._outboxes[i] = reply.arena
        for reply in replies:
            if isinstance(reply, Failure):
                message = (f"in replica {reply.index} (engine='process'): {reply.kind}: {reply.message}\n\n"
                           f"Traceback in the worker process:\n{reply.traceback}")
                raise _ERRORS.get(reply.kind, RuntimeError)(message)
        return replies

    def apply(self, module: nn.Module, inputs: Sequence[tuple], kwargs: Sequence[dict]) -> list:
        """``parallel_apply`` for the worker processes: one output per chunk, joined to the caller's graph."""
        n = len(inputs)
        for i, p in enumerate(self._procs):
            if not p.is_alive():
                code = p.exitcode
                self.close()
                raise WorkerDied(f"DataParallel(engine='process'): the worker process of replica {i} died since the "
                                 f"last call (exit code {code}); its workers are restarted on the next call")
        if not self._procs or structure(module) != self._signature:
            self._start(module)
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        training = [m.training for m in module.modules()]
        release, self._released = self._released, []
        chunks: list[torch.Tensor] = []
        positions: list[list[int]] = []
        msgs = []
        for i in range(n):
            leaves, spec = flatten((tuple(inputs[i]), dict(kwargs[i])))
            values = [v for _, v in leaves]
            wanted = [k for k, v in enumerate(values) if _tensor(v) is not None and _tensor(v).requires_grad]
            positions.append(list(range(len(chunks), len(chunks) + len(wanted))))
            chunks.extend(_tensor(values[k]) for k in wanted)
            sent = [v if _tensor(v) is None else _with_tensor(v, _tensor(v).detach()) for v in values]
            self._step += 1
            packed, grown = self._inboxes[i].pack(sent)
            msgs.append(Forward(self._step, packed, spec, wanted if grad else [], grad, training, release, grown))
        replies: list[Outputs] = self._exchange(msgs)
        flat, slices, rebuilt = [], [], []
        for i, reply in enumerate(replies):
            reply.leaves = unpack(self._outboxes[i], reply.leaves, copy=True)
            lo = len(flat)
            flat.extend(t for t in (_tensor(v) for v in reply.leaves) if t is not None)
            slices.append((lo, len(flat)))
        params = [p for p in module.parameters() if p.requires_grad]
        if grad and (chunks or params):
            step = _Step(self, [m.step for m in msgs], slices, positions, len(chunks))
            joined = iter(_Remote.apply(step, flat, *chunks, *params))
        else:
            joined = iter(flat)
        for reply in replies:
            rebuilt.append(unflatten(reply.spec, [v if _tensor(v) is None else _with_tensor(v, next(joined))
                                                  for v in reply.leaves]))
        return rebuilt
