"""The process engine's fixed shared-memory slots (process_engine.py), checked against the bare module: slot buffers
that grow with the batch, two forwards before one backward (the second must not overwrite what the first one's graph
saved), non-contiguous and mixed-dtype inputs, a PackedSequence (still pickled); and the caller's intra-op threads."""
import copy

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from fanfold import DataParallel
from fanfold.parallel.process_engine import Arena, layout, unpack, view

TOL = dict(rtol=1e-4, atol=1e-5)


class Masked(nn.Module):
    """A float input that the graph saves (tanh), an int64 index and a bool mask; two outputs, one of them int."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.emb = nn.Embedding(7, 3)

    def forward(self, x, idx, mask):
        y = self.fc(x).tanh() * x[:, :3] + self.emb(idx)
        return y * mask.unsqueeze(1), mask.sum().reshape(1)


def check_grads(bare, dp):
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"{name}: {m}")


def test_arena_round_trip_keeps_values_and_leaves_the_rest():
    arena = Arena()
    a, b = torch.arange(6.0).reshape(2, 3).t(), torch.tensor([True, False, True])
    packed, grown = arena.pack([a, "text", b, None, torch.tensor(3, dtype=torch.int16)])
    assert grown is arena.buffer and grown.is_shared()
    assert packed[1] == "text" and packed[3] is None
    got = unpack(grown, packed, copy=True)
    torch.testing.assert_close(got[0], a)
    torch.testing.assert_close(got[2], b)
    assert got[4].dtype == torch.int16 and int(got[4]) == 3 and got[4].shape == ()
    again, grown = arena.pack([a[:1]])  # smaller: same buffer, nothing to send
    assert grown is None and view(arena.buffer, again[0]).data_ptr() == arena.buffer.data_ptr()
    slots, size = layout([torch.zeros(3), torch.zeros(0), torch.zeros(1, dtype=torch.float64)])
    assert [s.offset % 64 for s in slots] == [0, 0, 0] and size == 128


def test_growing_batches_and_two_forwards_before_one_backward():
    torch.manual_seed(0)
    bare = Masked()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    g = torch.Generator().manual_seed(3)
    try:
        for rows in (4, 16, 64, 8):  # the slot buffers grow twice, then are reused
            batches = []
            for _ in range(2):
                x = torch.randn(5, rows, generator=g).t()  # non-contiguous
                idx = torch.randint(0, 7, (rows,), generator=g)
                mask = torch.rand(rows, generator=g) > 0.3
                batches.append((x, idx, mask))
            # both forwards first: the second reuses the slot buffers while the first's graph is still alive
            outs = [dp(*b) for b in batches]
            refs = [bare(*b) for b in batches]
            for (y, count), (y_ref, _), (_, _, mask) in zip(outs, refs, batches):
                torch.testing.assert_close(y, y_ref, **TOL)
                # each replica counts its own chunk's mask: the gathered counts are the two halves' sums
                assert count.dtype == torch.int64 and torch.equal(count, torch.stack([m.sum() for m in mask.chunk(2)]))
            sum(y.pow(2).sum() for y, _ in outs).backward()
            sum(y.pow(2).sum() for y, _ in refs).backward()
            check_grads(bare, dp)
            for m in (bare, dp.module):
                m.zero_grad(set_to_none=True)
    finally:
        dp.close()


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)

    def forward(self, packed):
        return self.lstm(packed)[1][0][-1]


def test_a_packed_sequence_travels_pickled_and_matches():
    torch.manual_seed(0)
    bare = PackedLSTM()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    x, lengths = torch.randn(6, 5, 3), torch.tensor([5, 5, 4, 3, 2, 1])
    try:
        # scatter splits it by sequences; each replica's PackedSequence is pickled (not a plain tensor)
        out = dp(pack_padded_sequence(x, lengths, batch_first=True))
        ref = bare(pack_padded_sequence(x, lengths, batch_first=True))
        torch.testing.assert_close(out, ref, **TOL)
        out.sum().backward()
        ref.sum().backward()
        check_grads(bare, dp)
    finally:
        dp.close()


def test_the_caller_runs_one_thread_while_the_workers_run_and_gets_its_threads_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    dp = DataParallel(nn.Linear(3, 2), ["cpu"] * 2, engine="process")
    try:
        x = torch.randn(4, 3)
        torch.testing.assert_close(dp(x), dp.module(x), **TOL)
        assert torch.get_num_threads() == 1  # its idle OpenMP threads would spin on the workers' cores
        dp.close()
        assert torch.get_num_threads() == 2
    finally:
        dp.close()
        torch.set_num_threads(before)


class SparseBag(nn.Module):
    """A sparse-gradient embedding, a dense layer and a frozen one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2).requires_grad_(False)

    def forward(self, idx):
        return self.frozen(self.fc(self.emb(idx)))


def test_sparse_gradients_stay_sparse_and_match_with_sparse_adam():
    torch.manual_seed(0)
    bare = SparseBag()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 3, engine="process")
    opts = [(torch.optim.SparseAdam([m.emb.weight], lr=0.1), torch.optim.SGD(m.fc.parameters(), lr=0.1))
            for m in (bare, dp.module)]
    g = torch.Generator().manual_seed(5)
    try:
        for rows in (6, 2, 1, 7):  # fewer rows than replicas too: some workers get nothing
            idx = torch.randint(0, 10, (rows,), generator=g)
            for m in (bare, dp):
                m(idx).pow(2).sum().backward()
            assert dp.module.emb.weight.grad.layout == torch.sparse_coo  # SparseAdam refuses dense gradients
            torch.testing.assert_close(dp.module.emb.weight.grad.to_dense(), bare.emb.weight.grad.to_dense(), **TOL)
            assert dp.module.frozen.weight.grad is None
            for pair in opts:
                for opt in pair:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
                torch.testing.assert_close(q, p, **TOL)
    finally:
        dp.close()
