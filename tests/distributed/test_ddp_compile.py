"""DDP under ``torch.compile`` (aot_eager), against torch's own DDP, uncompiled, in the same two ranks.

fanfold's DDP: only the wrapped module is traced, the forward's bookkeeping and buffer broadcast run eagerly; on gloo
and on the ``fanfold`` backend (before: dynamo traced into the transport and failed with "Guard failed on the same
frame"). torch's DDP on the ``fanfold`` backend: dynamo calls the group's collectives instead of tracing into them
(before: "Attempted to access unregistered member on an OpaqueObject", the group's ``_handout``), against torch's DDP
over gloo.
"""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fanfold


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()


def _largest_difference(ours, theirs, r):
    """Three steps of SGD with momentum on both, each rank on its own batches; the largest difference in parameters
    and buffers after any step. Then both wrappers go, ``theirs`` (torch's, uncompiled, on gloo) before its process
    group (see below)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    worst = 0.0
    for step in range(3):
        x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + r))
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            worst = max(worst, (a - b).abs().max().item())
        for a, b in zip(ours.buffers(), theirs.buffers()):
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    # torch's DDP goes while its process group is still referenced from Python. torch 2.13 stashes a Python object
    # in the thread state of every backward, so each gloo Work its reducer issues there holds one, released on
    # gloo's worker thread (taking the GIL) once the Work is done. A reducer holding the group's last reference
    # destroys the group with the GIL held and joins that thread: a rank hung at the caller's return, after its
    # destroy_process_group(), in 4 runs of 10. The group's own Python reference lets go of the GIL first.
    # (``ours`` may stay: fanfold's DDP has no such reducer; torch's compiled one, on the fanfold group, reduced
    # through shared memory, not gloo.)
    reducer = weakref.ref(theirs.reducer)
    del ours, theirs, opts, m, opt
    gc.collect()
    if reducer() is not None:
        raise RuntimeError(f"rank {r}: torch's reducer outlived its DDP; it must go before the process group")
    return worst


def _compiled_against_torch(backend):
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    ours = torch.compile(fanfold.DistributedDataParallel(_model()), backend="aot_eager")
    worst = _largest_difference(ours, torch.nn.parallel.DistributedDataParallel(_model()), dist.get_rank())
    dist.destroy_process_group()
    return worst


@pytest.mark.parametrize("backend", ["gloo", "fanfold"])
def test_compiled_fanfold_ddp_matches_torch_ddp(backend):
    worst = fanfold.launch(_compiled_against_torch, backend, nprocs=2, timeout=240)
    assert max(worst) < 1e-12, worst


def _torch_compiled_on_fanfold():
    torch.set_num_threads(1)
    dist.init_process_group("fanfold")
    gloo = dist.new_group(backend="gloo")
    ours = torch.compile(torch.nn.parallel.DistributedDataParallel(_model()), backend="aot_eager")
    # built in the call: a name here would keep it past _largest_difference's teardown
    worst = _largest_difference(ours, torch.nn.parallel.DistributedDataParallel(_model(), process_group=gloo),
                                dist.get_rank())
    dist.destroy_process_group()
    return worst


def test_torch_ddp_compiled_on_the_fanfold_backend_matches_gloo():
    worst = fanfold.launch(_torch_compiled_on_fanfold, nprocs=2, timeout=240)
    assert max(worst) < 1e-12, worst
