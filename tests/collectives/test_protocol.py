"""The collective interface (``fanfold.collectives.Transport``): both transports and the stall inspector implement it
in full, and TorchTransport.reduce_tensors gives what torch's own comm hooks give on the same gradients (the
oracle: torch's ``default_hooks`` run in the same gloo processes), reduce_scatter_tensors this rank's part of it."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fanfold
from fanfold.collectives import ShmTransport, TorchTransport, Transport, Work, resolve_transport
from fanfold.collectives.stall import InspectedTransport
from fanfold.distributed import init_process_group


def _gradients(r):
    """Gradient-like tensors of odd sizes whose magnitudes span 1e-7..10 (float16's subnormal range included)."""
    g = torch.Generator().manual_seed(100 + r)
    sizes = (1, 37, 1000, 4099)
    return [torch.randn(n, generator=g) * 10.0 ** (torch.rand(n, generator=g) * 8 - 7) for n in sizes]


def _reduce_both_ways():
    init_process_group(timeout=60)
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    torch_t, shm_t = TorchTransport(), ShmTransport(timeout=60)
    out = {"isinstance": [isinstance(t, Transport) for t in (torch_t, shm_t, InspectedTransport(torch_t))],
           "work": isinstance(torch_t.reduce_tensors([torch.ones(3)], bucket=0), Work)}
    for compress, hook in ((torch.bfloat16, default_hooks.bf16_compress_hook),
                           (torch.float16, default_hooks.fp16_compress_hook), (None, None)):
        ours = _gradients(r)
        work = torch_t.reduce_tensors(ours, bucket=1, divisor=n, compress=compress)
        assert isinstance(work, Work)
        work.wait()
        bucket = torch.cat(_gradients(r))  # the same gradients as one bucket, through torch's hook
        if hook is None:  # the default: the sum, then the division (fanfold's allreduce_hook)
            dist.all_reduce(bucket)
            expect = bucket / n
        else:
            expect = hook(None, (bucket,)).wait()
        out[str(compress)] = (torch.equal(torch.cat(ours), expect), torch.cat(ours), torch.cat(_gradients(r)))
        # reduce_scatter_tensors: this rank's part of the hook's result on the zero-padded bucket
        grads = _gradients(r)
        total = sum(g.numel() for g in grads)
        part = -(-total // n)
        got = torch.full((part,), 7.0)
        torch_t.reduce_scatter_tensors(grads, got, bucket=1, divisor=n, compress=compress).wait()
        padded = torch.cat(grads + [torch.zeros(part * n - total)])
        if hook is None:
            dist.all_reduce(padded)
            expect = padded / n
        else:
            expect = hook(None, (padded,)).wait()
        out[f"scatter {compress}"] = (torch.equal(got, expect[r * part:(r + 1) * part]),
                                      torch.equal(torch.cat(grads), torch.cat(_gradients(r))))
    shm_t.close()
    dist.destroy_process_group()
    return out


def test_both_transports_implement_the_protocol_and_torch_reduce_tensors_is_torch_hooks():
    results = fanfold.launch(_reduce_both_ways, nprocs=2, timeout=120)
    for out in results:
        assert out["isinstance"] == [True, True, True] and out["work"]
        for compress in ("torch.bfloat16", "torch.float16", "None"):
            same, ours, mine = out[compress]
            assert same, compress
            assert not torch.equal(ours, mine)  # really reduced
            assert out[f"scatter {compress}"] == (True, True), compress  # the part, the inputs untouched
    assert torch.equal(results[0]["torch.bfloat16"][1], results[1]["torch.bfloat16"][1])
    # compressed: rounded, and within a few roundings of the exact average (relative to the inputs' magnitudes)
    exact = results[0]["None"][1]
    scale = (results[0]["None"][2].abs() + results[1]["None"][2].abs()) / 2
    for compress, tol in (("torch.bfloat16", 1e-2), ("torch.float16", 2e-3)):
        got = results[0][compress][1]
        assert not torch.equal(got, exact)
        assert bool(((got - exact).abs() <= tol * scale + 1e-7).all()), compress


class _Partial:
    """The old duck-typed interface: no reduce_tensors."""

    rank, world_size = 0, 1

    def all_reduce(self, tensor, bucket=None, divisor=None):
        return None

    def broadcast(self, tensor, src):
        return None

    def barrier(self):
        return None


def test_a_transport_object_must_implement_the_whole_protocol():
    assert not isinstance(_Partial(), Transport)
    missing = r"\['reduce_tensors', 'reduce_scatter', 'reduce_scatter_tensors', 'all_gather'\]"
    with pytest.raises(TypeError, match=rf"lacks {missing} of fanfold.collectives.Transport"):
        resolve_transport(_Partial())
