"""Pipeline schedules: every step once, dependencies respected, the ideal bubble, 1F1B's activation bound.

The checks are written here from the definitions (a forward needs the previous stage's forward of the same
micro-batch; a backward needs its own forward and the next stage's backward), not with ``clocked``.
"""
from __future__ import annotations

import collections

import pytest
import torch

from fanfold._core.tree import flatten
from fanfold.pipeline import Step, gpipe, one_f_one_b
from fanfold.pipeline.channel import decode, encode
from fanfold.pipeline.schedule import clocked, stage_orders

SIZES = [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)]


def check_cycles(cycles: list[list[Step]], stages: int, microbatches: int) -> None:
    done: set[tuple] = set()
    for cycle in cycles:
        assert len({step.stage for step in cycle}) == len(cycle), f"a stage runs twice in one cycle: {cycle}"
        for step in cycle:
            s, m = step.stage, step.microbatch
            needs = [(s - 1, m, "F")] if step.phase == "F" and s else []
            if step.phase == "B":
                needs = [(s, m, "F")] + ([(s + 1, m, "B")] if s < stages - 1 else [])
            assert all(n in done for n in needs), f"{step} runs before {needs}"
        done |= {(step.stage, step.microbatch, step.phase) for step in cycle}
    assert done == {(s, m, p) for s in range(stages) for m in range(microbatches) for p in "FB"}


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_every_step_once_in_dependency_order_with_the_ideal_bubble(schedule, stages, microbatches):
    cycles = list(schedule(stages, microbatches))
    check_cycles(cycles, stages, microbatches)
    # a forward and a backward take one cycle each: every stage is busy 2M of 2(M + S - 1) cycles
    assert len(cycles) == 2 * (microbatches + stages - 1)
    idle = 1 - 2 * microbatches * stages / (len(cycles) * stages)
    assert idle == pytest.approx((stages - 1) / (microbatches + stages - 1))


@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_one_f_one_b_holds_at_most_stages_minus_s_microbatches(stages, microbatches):
    orders = stage_orders(one_f_one_b(stages, microbatches), stages, microbatches)
    for s, order in enumerate(orders):
        held = peak = 0
        for step in order:
            held += 1 if step.phase == "F" else -1
            peak = max(peak, held)
        assert peak == min(stages - s, microbatches)
    gpipe_orders = stage_orders(gpipe(stages, microbatches), stages, microbatches)
    assert all(order[:microbatches] == [Step(s, m, "F") for m in range(microbatches)]
               for s, order in enumerate(gpipe_orders))  # GPipe holds all M


def test_gpipe_is_the_diagonal_clock():
    assert [[repr(s) for s in c] for c in gpipe(2, 3)] == [
        ["F0@0"], ["F1@0", "F0@1"], ["F2@0", "F1@1"], ["F2@1"],
        ["B2@1"], ["B1@1", "B2@0"], ["B0@1", "B1@0"], ["B0@0"],
    ]


def test_deadlocks_and_incomplete_schedules_are_refused():
    with pytest.raises(ValueError, match="deadlocks"):
        list(clocked([[Step(0, 0, "B"), Step(0, 0, "F")]]))
    with pytest.raises(ValueError, match="deadlocks"):  # stage 1 waits for a forward stage 0 runs last
        stage_orders([[Step(0, 0, "B"), Step(1, 0, "F"), Step(0, 0, "F"), Step(1, 0, "B")]], 2, 1)
    with pytest.raises(ValueError, match="never runs"):
        stage_orders([[Step(0, 0, "F")]], 1, 1)
    with pytest.raises(ValueError, match="twice"):
        stage_orders([[Step(0, 0, "F")], [Step(0, 0, "F")], [Step(0, 0, "B")]], 1, 1)
    with pytest.raises(ValueError, match="outside"):
        stage_orders([[Step(2, 0, "F")]], 2, 1)
    with pytest.raises(TypeError, match="lists of Step"):
        stage_orders([[(0, 0, "F")]], 1, 1)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        list(gpipe(2, 0))


Pair = collections.namedtuple("Pair", "x mask")


@pytest.mark.parametrize("value", [
    torch.randn(3, 4),
    (torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.bool)),
    [torch.arange(6).reshape(2, 3)] * 40,  # a header longer than the first message
    [torch.randn(2, 3, 4, 5, 6, 7), None, torch.randn(1, dtype=torch.float64)] * 4,  # gradients, some missing
    {"x": torch.randn(2, 3), "pair": Pair(torch.randn(2), torch.ones(2, dtype=torch.bool)), "scale": 0.5},
], ids=["tensor", "tuple", "long-list", "grads-with-none", "dict-namedtuple-float"])
def test_messages_between_processes_round_trip(value):
    header, payload = encode(value)
    sent = iter(payload)

    def receive(shape, dtype):  # what the receiver allocates must be what was sent
        t = next(sent)
        assert (t.shape, t.dtype) == (shape, dtype)
        return t.clone()

    got = decode(header, receive)
    assert next(sent, None) is None
    want, _ = flatten(value)
    leaves, _ = flatten(got)
    assert type(got) is type(value) and [str(p) for p, _ in leaves] == [str(p) for p, _ in want]
    for (_, a), (_, b) in zip(leaves, want):
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype
        else:
            assert a == b
