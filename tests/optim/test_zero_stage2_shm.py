"""ZeRO stage 2 on the shm transport: one reduce-scatter per bucket and synchronised backward (no all-reduce), on 2
and 3 ranks, against one process training on the whole batch with plain torch Adam (20 steps): with no_sync
accumulation and clipping, and with two synchronised backwards accumulating into the parts (no zero_grad between
them: the reduction lands in a temporary, added to the part).
"""
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from test_zero_training import MAX_NORM, MICRO, OPTS, STEPS, _data, _loss, _model, oracle

import fanfold
from fanfold.collectives.shm.transport import ShmTransport
from fanfold.distributed import init_process_group

CAPS = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)  # several buckets of the 5,768-element MLP


def _train(accumulate):
    model = _model()
    ddp = fanfold.DistributedDataParallel(model, transport="shm", **CAPS)
    cls, kw = OPTS["adam"]
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
    ddp.shard_gradients(opt)
    r, n = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            if m < MICRO - 1 and not accumulate:
                with ddp.no_sync():
                    _loss(ddp, *_data(step, m, r, n)).backward()
            else:  # accumulate: every micro-batch synchronised, added to the parts the last one filled
                _loss(ddp, *_data(step, m, r, n)).backward()
        fanfold.clip_grad_norm_(opt, MAX_NORM)
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "buckets": len(ddp.reducer.buckets),
            "grads none": all(p.grad is None for p in model.parameters())}


def _ranks():
    init_process_group(timeout=60)
    torch.set_num_threads(1)
    calls = {"scatter": 0, "all_reduce": 0}
    scatter, reduce = ShmTransport.reduce_scatter_tensors, ShmTransport.reduce_tensors

    def counted(name, fn):
        def call(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)
        return call

    out = {}
    with mock.patch.object(ShmTransport, "reduce_scatter_tensors", counted("scatter", scatter)), \
            mock.patch.object(ShmTransport, "reduce_tensors", counted("all_reduce", reduce)):
        for accumulate in (False, True):
            out[accumulate] = _train(accumulate)
            out[accumulate]["calls"] = dict(calls)
            calls.update(scatter=0, all_reduce=0)
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_stage2_reduce_scatters_each_bucket_and_equals_torch_adam(nprocs):
    out = fanfold.launch(_ranks, nprocs=nprocs, timeout=240)
    want, _ = oracle("adam")
    for o in out:
        for accumulate in (False, True):
            res = o[accumulate]
            syncs = STEPS * (MICRO if accumulate else 1)
            # the path taken: one reduce-scatter per bucket and synchronised backward, no all-reduce
            assert res["calls"] == {"scatter": syncs * res["buckets"], "all_reduce": 0}, res["calls"]
            assert res["grads none"]
            for a, b in zip(res["params"], want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
