"""fanfold.data: torch's sampler as the oracle for the order; exact mid-epoch resume; exact evaluation over gloo."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

import fanfold
from fanfold.training.data import DistributedSampler, gather_evaluation


def _samplers(n, world, **kw):
    return [DistributedSampler(range(n), num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize("n,world,kw", [(10, 3, {}), (10, 3, {"drop_last": True}), (7, 2, {"shuffle": False}),
                                        (1, 4, {}), (0, 2, {}), (12, 4, {"seed": 5})])
def test_same_order_as_torch_and_epochs_advance_by_themselves(n, world, kw):
    ours = _samplers(n, world, **kw)
    for epoch in range(3):
        for r, s in enumerate(ours):
            theirs = TorchSampler(range(n), num_replicas=world, rank=r, **kw)
            theirs.set_epoch(epoch)
            assert list(s) == list(theirs)  # no set_epoch on ours: each new iter() is the next epoch
            assert s.epoch == epoch and len(s) == len(theirs)
    s = ours[0]
    s.set_epoch(7)
    theirs = TorchSampler(range(n), num_replicas=world, rank=0, **kw)
    theirs.set_epoch(7)
    assert list(s) == list(theirs) and s.epoch == 7


def test_shuffle_differs_between_epochs():
    s = DistributedSampler(range(100), num_replicas=1, rank=0)
    assert list(s) != list(s)


def _run(samplers, steps, batch):
    """Lock-step training loop over one DataLoader per rank: ``steps`` batches each (None: to the epoch's end)."""
    loaders = [iter(DataLoader(range(10**6), batch_size=batch, sampler=s)) for s in samplers]
    seen, k = [], 0
    while steps is None or k < steps:
        try:
            batches = [next(it) for it in loaders]
        except StopIteration:
            break
        seen += [i for b in batches for i in b.tolist()]
        k += 1
    return seen


@pytest.mark.parametrize("n,world,new_world,batch,kw", [
    (103, 2, 2, 4, {}), (103, 2, 3, 4, {}), (103, 4, 1, 5, {}), (100, 3, 2, 2, {"drop_last": True}),
    (50, 2, 5, 3, {"shuffle": False}),
])
def test_resume_mid_epoch_no_sample_repeated_or_skipped(n, world, new_world, batch, kw):
    # Uninterrupted: epochs 0 and 1 on `world` ranks.
    ref = _samplers(n, world, seed=3, **kw)
    ref_epochs = [sorted(_run(ref, None, batch)), _run(ref, None, batch)]
    # Interrupted after 3 steps of epoch 1, resumed on `new_world` ranks.
    run = _samplers(n, world, seed=3, **kw)
    assert sorted(_run(run, None, batch)) == ref_epochs[0]
    first = _run(run, 3, batch)
    state = run[0].state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 3 * batch * world)
    resumed = _samplers(n, new_world, seed=3, **kw)
    for s in resumed:
        s.load_state_dict(state)
    rest = _run(resumed, None, batch)
    got = first + rest
    consumed = 3 * batch * world
    if kw.get("drop_last"):
        assert len(got) == len(set(got)) == consumed + (n - consumed) // new_world * new_world
    else:
        assert set(got) == set(range(n))  # nothing skipped
        assert len(got) - n == -(n - consumed) % new_world  # repeated: only the padding the new split needs
    if new_world == world:
        assert sorted(got) == sorted(ref_epochs[1])  # the same multiset, padding included
    # After the resumed epoch, the next epoch is epoch 2 in full.
    assert resumed[0].state_dict()["epoch"] == 2 and resumed[0].epoch == 1
    nxt = _run(resumed, None, batch)
    assert resumed[0].epoch == 2 and set(nxt) == (set(range(n)) if not kw.get("drop_last") else set(nxt))


def test_same_world_size_resume_is_identical_per_rank():
    ref = _samplers(45, 2, seed=1)
    full = [list(s) for s in ref]
    run = _samplers(45, 2, seed=1)
    its = [iter(s) for s in run]
    head = [[next(it) for _ in range(7)] for it in its]
    state = run[0].state_dict()
    resumed = _samplers(45, 2, seed=1)
    for s in resumed:
        s.load_state_dict(state)
    assert [h + list(s) for h, s in zip(head, resumed)] == full


def test_end_of_epoch_state_points_at_next_epoch_and_set_epoch_keeps_resume():
    s = DistributedSampler(range(10), num_replicas=2, rank=0)
    assert s.state_dict()["epoch"] == 0 and s.state_dict()["consumed"] == 0
    list(s)
    assert (s.state_dict()["epoch"], s.state_dict()["consumed"]) == (1, 0)
    t = DistributedSampler(range(10), num_replicas=2, rank=0)
    t.load_state_dict({**s.state_dict(), "epoch": 4, "consumed": 6})
    t.set_epoch(4)  # a torch-style loop calling set_epoch(start_epoch) keeps the resume point
    assert len(list(t)) == 2 and t.epoch == 4
    u = DistributedSampler(range(10), num_replicas=2, rank=0)
    u.load_state_dict({**s.state_dict(), "epoch": 4, "consumed": 6})
    u.set_epoch(5)  # another epoch starts from its beginning
    assert len(list(u)) == 5


def test_prefetching_loader_uses_set_consumed():
    s = DistributedSampler(range(40), num_replicas=2, rank=0)
    it = iter(s)
    taken = [next(it) for _ in range(8)]  # a loader with workers fetched 8, the loop finished 4
    assert s.state_dict()["consumed"] == 16
    s.set_consumed(4)
    assert s.state_dict()["consumed"] == 8
    t = DistributedSampler(range(40), num_replicas=2, rank=0)
    t.load_state_dict(s.state_dict())
    rest = list(t)
    assert rest == list(DistributedSampler(range(40), num_replicas=2, rank=0))[4:]
    assert taken[4:] == rest[:4]  # what was fetched but not trained on comes again
    with pytest.raises(ValueError, match="samples must be in"):
        s.set_consumed(21)


def test_bad_arguments_and_states_are_refused():
    with pytest.raises(ValueError, match="rank must be"):
        DistributedSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedSampler(range(4), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="contradicts"):
        DistributedSampler(range(4), num_replicas=2, rank=0, drop_last=True, even=False)
    with pytest.raises(TypeError, match="length"):
        DistributedSampler(iter(range(4)), num_replicas=1, rank=0)
    s = DistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
    good = s.state_dict()
    for bad, msg in [({**good, "seed": 2}, "seed=2"), ({**good, "num_samples": 11}, "num_samples=11"),
                     ({**good, "consumed": 11}, "consumed=11"), ({"epoch": 0}, "lacks")]:
        with pytest.raises(ValueError, match=msg):
            s.load_state_dict(bad)


def _evaluate(sizes):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    for n in sizes:
        for even in (False, True):
            data = TensorDataset(torch.arange(n) * 10, torch.arange(n))
            sampler = DistributedSampler(data, shuffle=True, seed=2, even=even)
            got, ids = [], []
            for x, i in DataLoader(data, batch_size=64, sampler=sampler):
                got.append(x + 1)  # the "prediction" of sample i is 10 * i + 1
                ids.append(i)
            rows = gather_evaluation(torch.cat(got), sampler)
            out[n, even] = (rows, len(torch.cat(ids)))
    return out


def test_exact_evaluation_counts_each_sample_once_over_two_ranks():
    sizes = (1000, 1001)
    res = fanfold.launch(_evaluate, sizes, nprocs=2, timeout=120)
    for n in sizes:
        for even in (False, True):
            rows0, local0 = res[0][n, even]
            rows1, local1 = res[1][n, even]
            assert torch.equal(rows0, torch.arange(n) * 10 + 1) and torch.equal(rows1, rows0)
            # Padding exists on the even sampler with 1,001 samples (1,002 handed out) and is dropped.
            assert local0 + local1 == (n + n % 2 if even else n)
