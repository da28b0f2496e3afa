"""The process engine's messages between the caller and a worker, and their compact form for repeated steps.

Every message is a small dataclass. A training loop sends the same four every step (``Forward``, ``Outputs``,
``Backward``, ``Gradients``) with the same structure: the same slots (``process_slots.Arena`` hands out the same
``Slot`` objects while the shapes repeat), the same spec, the same flags; only the step numbers change. ``Codec``
sends such a repeat as a few bytes of ``struct`` (its numbers) instead of pickling it again: the receiver rebuilds
it from the last full message of that kind it got. Anything else (a new structure, a new slot buffer, a leaf that is
not a Slot or an immutable scalar, ``Ready``, ``Failure``) is pickled as before. A pickle starts with its protocol
byte (0x80), a compact message with its kind's tag (1 to 4), so the receiver tells them apart by the first byte.
A sender remembers a message as the template of its kind only once it has been posted, so a message that could not
be pickled is never a template the receiver lacks. Each mailbox side has its own ``Codec``; a restart makes new ones.
Layer: ``process_slots`` <- ``process_messages`` <- ``process_mailbox`` / ``process_worker``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.tree import Spec
from .process_slots import Slot


@dataclass
class Forward:
    step: int
    leaves: list  # the replica's flattened (args, kwargs), tensors detached
    spec: Spec
    differentiable: list[int]  # positions in ``leaves`` whose gradient the caller wants
    grad: bool  # the caller's grad mode
    training: list[bool]  # module.training of every submodule, in modules() order
    release: list[int] = field(default_factory=list)  # steps whose graph the caller has dropped
    arena: torch.Tensor | None = None  # the caller's slot buffer for this worker, when new


@dataclass
class Backward:
    step: int
    grads: list  # one per output tensor (its Slot), None where the caller has none
    arena: torch.Tensor | None = None


@dataclass
class Ready:
    index: int
    pid: int


@dataclass
class Outputs:
    leaves: list  # the output flattened, tensors as Slots of the worker's buffer
    spec: Spec
    arena: torch.Tensor | None = None  # the worker's slot buffer, when new


@dataclass
class Gradients:
    # per parameter that requires grad: True where its gradient slot holds it, None where unused, or the gradient
    # itself where it is not dense (sparse: nn.Embedding(sparse=True)), pickled
    parameters: list
    inputs: list  # one per ``Forward.differentiable`` position: a Slot, or None
    arena: torch.Tensor | None = None


@dataclass
class Failure:
    index: int
    kind: str  # the exception's type name
    message: str
    traceback: str


_TAGS = {Forward: 1, Backward: 2, Outputs: 3, Gradients: 4}
_FORWARD = struct.Struct("<BqBI")  # tag, step, grad, number of released steps (then one int64 each)
_BACKWARD = struct.Struct("<Bq")  # tag, step
_RELEASED = struct.Struct("<q")
_SCALARS = (Slot, type(None), bool, int, float, str)  # leaves that are the same value when they are the same object


def _plain_spec(spec: Spec) -> bool:
    """Whether ``spec`` compares by value: no instance kept as a template (a dataclass, a dict subclass)."""
    return all(node.template is None or isinstance(node.template, type) for node in spec.nodes)


def _scalars(leaves: list) -> bool:
    return all(type(v) in _SCALARS for v in leaves)


def _same(leaves: list, last: list) -> bool:
    return len(leaves) == len(last) and all(a is b for a, b in zip(leaves, last))


def _repeats(msg: Any, last: Any) -> bool:
    """Whether ``msg`` has the structure of ``last`` (a template: checked by ``_template``), its numbers aside."""
    if msg.arena is not None:
        return False
    if type(msg) is Forward:
        return (_same(msg.leaves, last.leaves) and msg.training == last.training
                and msg.differentiable == last.differentiable and msg.spec == last.spec)
    if type(msg) is Outputs:
        return _same(msg.leaves, last.leaves) and msg.spec == last.spec
    if type(msg) is Backward:
        return _same(msg.grads, last.grads)
    return _same(msg.inputs, last.inputs) and msg.parameters == last.parameters


def _template(msg: Any) -> bool:
    """Whether later messages may repeat ``msg``: its leaves and spec compare by identity and value."""
    if type(msg) in (Forward, Outputs):
        return _scalars(msg.leaves) and _plain_spec(msg.spec)
    if type(msg) is Backward:
        return _scalars(msg.grads)
    return _scalars(msg.inputs) and all(p is True or p is None for p in msg.parameters)


class Codec:
    """One mailbox side's memory of the last full message of each kind, sent and received."""

    def __init__(self) -> None:
        self._sent: dict[type, Any] = {}
        self._got: dict[type, Any] = {}

    def encode(self, msg: Any) -> bytes | None:
        """``msg`` in compact form when it repeats the last one of its kind sent, else None (pickle it)."""
        last = self._sent.get(type(msg))
        if last is None or not _repeats(msg, last):
            return None
        if type(msg) is Forward:
            return _FORWARD.pack(1, msg.step, msg.grad, len(msg.release)) + b"".join(
                _RELEASED.pack(s) for s in msg.release)
        if type(msg) is Backward:
            return _BACKWARD.pack(2, msg.step)
        return bytes((_TAGS[type(msg)],))

    def sent(self, msg: Any) -> None:
        """``msg`` was posted in full: it is the template of its kind from now on (or none, if it cannot be one)."""
        if type(msg) in _TAGS:
            self._sent[type(msg)] = msg if _template(msg) else None

    def got(self, msg: Any) -> None:
        """``msg`` was received in full: the receiver's template of its kind."""
        if type(msg) in _TAGS:
            self._got[type(msg)] = msg

    def decode(self, data: bytes) -> Any:
        """The message a compact ``data`` stands for."""
        tag = data[0]
        if tag == 1:
            _, step, grad, n = _FORWARD.unpack_from(data)
            t = self._got[Forward]
            release = [_RELEASED.unpack_from(data, _FORWARD.size + 8 * k)[0] for k in range(n)]
            return Forward(step, t.leaves, t.spec, t.differentiable, bool(grad), t.training, release)
        if tag == 2:
            t = self._got[Backward]
            return Backward(_BACKWARD.unpack_from(data)[1], t.grads)
        if tag == 3:
            t = self._got[Outputs]
            return Outputs(t.leaves, t.spec)
        t = self._got[Gradients]
        return Gradients(t.parameters, t.inputs)
