"""The collectives of the ``fanfold`` backend, each called with tensors that the last rank of the group varies
(``VARIANTS``): more elements, a size across a path's threshold, another dtype, another op, an output that does
not fit the input. ``call(collective, variant, group)`` issues one and waits for it (test_backend_mismatch.py)."""
import torch
import torch.distributed as dist

SMALL = 6  # elements per rank: the latency path
BIG = 100_000  # float32 elements per rank (400 KB): past the latency path and the peer reads' threshold (256 KB)

# what the last rank changes: (its elements per rank, its dtype, its op, elements added to its input, to its output)
VARIANTS = {
    "more": (SMALL + 2, torch.float32, dist.ReduceOp.SUM, 0, 0),
    "bigger": (BIG, torch.float32, dist.ReduceOp.SUM, 0, 0),
    "bigger float64": (BIG, torch.float64, dist.ReduceOp.SUM, 0, 0),
    "float64": (SMALL, torch.float64, dist.ReduceOp.SUM, 0, 0),
    "bool": (SMALL, torch.bool, dist.ReduceOp.SUM, 0, 0),
    "complex": (SMALL, torch.complex64, dist.ReduceOp.SUM, 0, 0),
    "int avg": (SMALL, torch.int64, dist.ReduceOp.AVG, 0, 0),
    "band": (SMALL, torch.float32, dist.ReduceOp.BAND, 0, 0),
    "input more": (SMALL, torch.float32, dist.ReduceOp.SUM, 2, 0),
    "output more": (SMALL, torch.float32, dist.ReduceOp.SUM, 0, 2),
}
AGREED = (SMALL, torch.float32, dist.ReduceOp.SUM, 0, 0)  # every other rank's, and the last rank's in "agreed"
REDUCING = {"all_reduce", "all_reduce avg", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_tensor_coalesced"}
FITTING = {"all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all"}


def applies(collective: str, variant: str) -> bool:
    """Whether ``variant`` changes what the last rank passes to ``collective`` (an op for a reduction, an output's
    size for a collective with an output)."""
    k, dtype, op, more_in, more_out = VARIANTS[variant]
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and collective not in REDUCING:
        return False
    if op == dist.ReduceOp.AVG and collective not in ("all_reduce", "all_reduce avg"):
        return False
    return not (more_in or more_out) or collective in FITTING


def _full(k: int, dtype: torch.dtype, value: int) -> torch.Tensor:
    return torch.full((k,), value, dtype=torch.float32).to(dtype)


def call(collective: str, variant: str | None, group) -> list[torch.Tensor]:
    """Issue ``collective`` on ``group``, the last rank with ``variant`` (None: as every other rank), and wait; the
    output tensors."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    k, dtype, op, more_in, more_out = VARIANTS[variant] if variant is not None and r == n - 1 else AGREED
    if collective == "all_reduce avg" and op == dist.ReduceOp.SUM:
        op = dist.ReduceOp.AVG
    x = _full(k, dtype, r + 1)
    if collective in ("all_reduce", "all_reduce avg"):
        dist.all_reduce(x, op=op, group=group)
        return [x]
    if collective == "all_reduce_coalesced":
        xs = [x, _full(3, dtype, r + 1)]
        dist.all_reduce_coalesced(xs, op=op, group=group)
        return xs
    if collective == "broadcast":
        dist.broadcast(x, group_src=0, group=group)
        return [x]
    if collective == "all_gather":
        outs = [torch.empty(k, dtype=dtype) for _ in range(n)]
        outs[0] = torch.empty(k + more_out, dtype=dtype)
        dist.all_gather(outs, _full(k + more_in, dtype, r + 1), group=group)
        return outs
    if collective == "all_gather_into_tensor":
        out = torch.empty(n * k + more_out, dtype=dtype)
        dist.all_gather_into_tensor(out, _full(k + more_in, dtype, r + 1), group=group)
        return [out]
    if collective == "all_gather_into_tensor_coalesced":
        # torch's functional collectives (DTensor, FSDP2) call this form from C++
        outs = [torch.empty(n * k + more_out, dtype=dtype), torch.empty(n * 3, dtype=dtype)]
        group.all_gather_single_coalesced(outs, [_full(k + more_in, dtype, r + 1), _full(3, dtype, r + 1)]).wait()
        return outs
    if collective == "reduce_scatter":
        ins = [_full(k, dtype, r + 1 + q) for q in range(n)]
        ins[-1] = _full(k + more_in, dtype, r + 1)
        out = torch.empty(k + more_out, dtype=dtype)
        dist.reduce_scatter(out, ins, op=op, group=group)
        return [out]
    if collective in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        # the field's case: the last rank's input has 2 elements more than the group's size times its output
        inp, out = _full(n * k + more_in, dtype, r + 1), torch.empty(k + more_out, dtype=dtype)
        if collective == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(out, inp, op=op, group=group)
            return [out]
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        group.reduce_scatter_single_coalesced([out], [inp], opts).wait()
        return [out]
    if collective == "all_to_all_single":
        inp, out = _full(n * k + more_in, dtype, r + 1), torch.empty(n * k + more_out, dtype=dtype)
        dist.all_to_all_single(out, inp, group=group)
        return [out]
    if collective == "all_to_all":
        outs = [torch.empty(k + (more_out if q == 0 else 0), dtype=dtype) for q in range(n)]
        ins = [_full(k + (more_in if q == 0 else 0), dtype, r + 1 + q) for q in range(n)]
        dist.all_to_all(outs, ins, group=group)
        return outs
    if collective == "barrier":
        dist.barrier(group=group)
        return []
    raise ValueError(f"no collective {collective!r}")


COLLECTIVES = ["all_reduce", "all_reduce avg", "all_reduce_coalesced", "broadcast", "all_gather",
               "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all"]
