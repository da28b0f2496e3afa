"""The process engine's compact step messages (process_engine.py) through a real mailbox pair: every message must
arrive equal to what was sent (the oracle: the message itself, as pickling would deliver it), repeats in a few bytes
(also where forward and backward messages alternate in one slot buffer),
and anything whose structure changed, that cannot repeat by identity, or that failed to pickle, in full."""
import time

import pytest
import torch

from fanfold._core.tree import flatten
from fanfold.parallel.process_engine import WORKER, Arena, Backward, Failure, Forward, Gradients, Mailbox, Outputs


def no_check():
    pass


def through(sender, receiver, msg):
    """``msg`` sent and received (the protocol alternates, so the receiver then answers with a dummy); and the
    bytes it took."""
    sender.send(msg)
    size = sender._lengths[sender.side].value
    got = receiver.receive(no_check, time.monotonic() + 10)
    receiver.send(None)
    sender.receive(no_check, time.monotonic() + 10)
    return got, size


@pytest.fixture
def pair():
    caller = Mailbox()
    return caller, Mailbox(caller.block, WORKER)


def test_repeated_step_messages_arrive_equal_and_small(pair):
    caller, worker = pair
    arena = Arena()
    x = torch.randn(4, 3)
    _, spec = flatten(((x,), {"scale": 2}))
    sizes = []
    for step in range(1, 5):
        leaves, grown = arena.pack([x + step, 2])
        msg = Forward(step, leaves, spec, [0], step % 2 == 0, [True, False], [step - 1] if step > 1 else [], grown)
        got, size = through(caller, worker, msg)
        if step > 1:  # the first carries the new buffer: compared apart from it
            assert got == msg
        sizes.append(size)
        back = Backward(step, arena.pack([torch.ones(4, 2), None])[0])  # another structure in the same buffer
        got, back_size = through(caller, worker, back)
        assert got == back and (step == 1 or back_size <= 9)  # the same slots every step: compact
        reply = Gradients([True, None], leaves[:1])
        assert through(worker, caller, reply)[0] == reply
        out = Outputs(leaves[:1], spec)
        assert through(worker, caller, out)[0] == out
    assert sizes[0] > 100 and max(sizes[1:]) <= 1 + 8 * 3  # kind, step, grad mode, one released step


def test_a_changed_structure_or_an_unsafe_leaf_is_sent_in_full(pair):
    caller, worker = pair
    arena = Arena()
    _, spec = flatten(((1,), {}))
    leaves, _ = arena.pack([torch.zeros(2)])
    first = Forward(1, leaves, spec, [], True, [True])
    through(caller, worker, first)
    for changed in (Forward(2, leaves, spec, [], True, [False]),  # training flag
                    Forward(3, leaves, spec, [0], True, [True]),  # differentiable inputs
                    Forward(4, arena.pack([torch.zeros(3)])[0], spec, [], True, [True])):  # shapes: new slots
        got, size = through(caller, worker, changed)
        assert got == changed and size > 50
    box = [1]  # a mutable leaf: the same object may hold another value next time
    for value in (1, 2):
        box[0] = value
        got, size = through(caller, worker, Forward(5, [box], spec, [], True, [True]))
        assert got.leaves == [[value]] and size > 50
    failure = Failure(1, "ValueError", "m", "tb")
    assert through(worker, caller, failure)[0] == failure


def test_a_message_that_failed_to_pickle_is_no_template(pair):
    caller, worker = pair
    _, spec = flatten(((1,), {}))
    ok = Forward(1, [3], spec, [], True, [True])
    through(caller, worker, ok)
    with pytest.raises(Exception):
        caller.send(Forward(2, [3], spec, [], True, [True], arena=lambda: None))  # unpicklable: never posted
    again = Forward(3, [3], spec, [], True, [True])
    got, size = through(caller, worker, again)
    assert got == again and size < 30  # compact against the message the worker did get
