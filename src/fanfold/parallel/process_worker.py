"""One replica in its own process, for ``DataParallel(..., engine="process")``: the worker's loop, and the forward and
backward steps (``run_forward``, ``run_backward``) that the caller also uses to run replica 0 itself.

The worker's module aliases the caller's shared memory; its parameters become leaves of its own, so its graph ends
there. It exits when the caller sets the stop word or its process is gone; Ctrl-C is the caller's.
"""
from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._core.shm import alive
from .._core.tree import Spec, flatten, unflatten
from .parallel_backward import _alias_parameters, _tensor, _with_tensor
from .process_mailbox import WORKER, Backward, Failure, Forward, Gradients, Mailbox, Outputs, Ready, Stopped
from .process_slots import Arena, Slot, unpack, view


def _private_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give ``module`` private copies of its (shared) buffers; returns (shared, private) pairs to refresh them."""
    pairs = []
    for m in module.modules():
        for key, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[key] = b.clone()
                pairs.append((b, m._buffers[key]))
    return pairs


@dataclass
class _Buffers:
    """This worker's shared slot buffers: the caller's (read), its own (written), and its parameter gradients'."""

    inbox: torch.Tensor
    outbox: Arena
    grads: list[torch.Tensor]  # per parameter that requires grad, its gradient slot (a view of one shared buffer)


def _detach(leaf: Any) -> Any:
    t = _tensor(leaf)
    return leaf if t is None else _with_tensor(leaf, t.detach())


@dataclass
class Graph:
    """One replica's graph of one forward: its output tensors and what to differentiate (parameters, then the
    inputs whose gradient the caller wants)."""

    outputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    num_inputs: int


@dataclass
class Replica:
    """A replica as ``run_forward`` runs it: the module, its submodules in ``modules()`` order (walked once), and its
    own leaves for the parameters that require grad."""

    module: nn.Module
    modules: list[nn.Module]
    params: list[torch.Tensor]


def replica_of(module: nn.Module) -> Replica:
    """``module`` as a replica: each parameter that requires grad swapped for a leaf of its own on the same memory."""
    _, aliases, _ = _alias_parameters([module])
    return Replica(module, list(module.modules()), aliases[0])


def run_forward(replica: Replica, leaves: list, spec: Spec, differentiable: list[int], grad: bool,
                training: list[bool]) -> tuple[list, Spec, Graph | None]:
    """Run one replica on its flattened arguments (tensors detached, owned by this call): its output's leaves, their
    spec, and its graph (None without grad). Shared by the workers and the caller's own replica 0."""
    for m, flag in zip(replica.modules, training):
        if m.training is not flag:  # nn.Module.__setattr__ is slow: most steps change nothing
            m.training = flag
    inputs = []
    for k in differentiable:
        t = _tensor(leaves[k]).requires_grad_(grad)
        inputs.append(t)
        # a clone, so that the module may modify its argument in place as it may a non-leaf in the caller
        leaves[k] = _with_tensor(leaves[k], t.clone() if grad else t)
    args, kwargs = unflatten(spec, leaves)
    with torch.set_grad_enabled(grad):
        out = replica.module(*args, **kwargs)
    out_leaves, out_spec = flatten(out, "output")
    values = [v for _, v in out_leaves]
    if not grad:
        return values, out_spec, None
    tensors = [t for t in (_tensor(v) for v in values) if t is not None]
    return values, out_spec, Graph(tensors, replica.params + inputs, len(inputs))


def run_backward(graph: Graph, grads: list) -> list:
    """The gradients of ``graph.targets`` given those of its outputs (None where the caller has none), or None where
    unused. The graph is kept (retain_graph) until its owner drops it."""
    pairs = [(o, g) for o, g in zip(graph.outputs, grads) if g is not None and o.requires_grad]
    if not pairs or not graph.targets:
        return [None] * len(graph.targets)
    return list(torch.autograd.grad([o for o, _ in pairs], graph.targets, [g for _, g in pairs],
                                    retain_graph=True, allow_unused=True))


def _forward(replica: Replica, msg: Forward, graphs: dict, io: _Buffers) -> Outputs:
    # copies: the graph may save an input for backward, and the caller reuses its buffer for the next forward
    leaves = unpack(io.inbox, msg.leaves, copy=True)
    values, spec, graph = run_forward(replica, leaves, msg.spec, msg.differentiable, msg.grad, msg.training)
    if graph is not None:
        graphs[msg.step] = graph
    packed, grown = io.outbox.pack([_detach(v) for v in values])
    return Outputs(packed, spec, grown)


def _backward(msg: Backward, graphs: dict, io: _Buffers) -> Gradients:
    if msg.step not in graphs:
        raise RuntimeError("this worker holds no graph of that forward: the workers were restarted since (a "
                           "structure change, a dead worker or close()); run the forward again")
    graph = graphs[msg.step]  # kept until the caller releases it
    grads = run_backward(graph, unpack(io.inbox, msg.grads, copy=False))  # read before answering: no copy needed
    split = len(graph.targets) - graph.num_inputs
    with torch.no_grad():
        for g, slot in zip(grads[:split], io.grads):
            if g is not None and g.layout == torch.strided:
                slot.copy_(g)
    packed, grown = io.outbox.pack(grads[split:])
    return Gradients([g if g is None or g.layout != torch.strided else True for g in grads[:split]], packed, grown)


def _check_caller(pid: int) -> None:
    """Raise OSError once the caller's process is gone (a zombie, killed but not yet reaped, counts as gone)."""
    if not alive(pid):
        raise ProcessLookupError(pid)


def worker_main(index: int, module: nn.Module, block: torch.Tensor, threads: int, caller: int, grads: torch.Tensor,
                grad_slots: list[Slot]) -> None:
    """The worker process's entry point: serve its mailbox until told to stop or the caller is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    replica = replica_of(module)
    refresh = _private_buffers(module) if index > 0 else []
    io = _Buffers(torch.empty(0, dtype=torch.uint8), Arena(), [view(grads, slot) for slot in grad_slots])
    graphs: dict = {}
    mailbox = Mailbox(block, WORKER)
    mailbox.send(Ready(index, os.getpid()))
    while True:
        try:
            msg = mailbox.receive(lambda: _check_caller(caller))
        except (Stopped, OSError):
            return
        try:
            if msg.arena is not None:
                io.inbox = msg.arena
            if isinstance(msg, Forward):
                for step in msg.release:
                    graphs.pop(step, None)
                with torch.no_grad():
                    for shared, private in refresh:
                        private.copy_(shared)
                reply: Any = _forward(replica, msg, graphs, io)
            else:
                reply = _backward(msg, graphs, io)
        except Exception as exc:
            reply = Failure(index, type(exc).__name__, str(exc), traceback.format_exc())
        del msg
        try:
            mailbox.send(reply)
        except Exception as exc:  # an output that cannot be pickled: the caller must still get an answer
            io.outbox = Arena()  # it may have grown unsent: the next answer sends a fresh one
            mailbox.send(Failure(index, type(exc).__name__, f"cannot send the replica's answer: {exc}",
                                 traceback.format_exc()))
        del reply
