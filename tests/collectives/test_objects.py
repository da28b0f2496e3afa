"""fanfold's object collectives against torch's own (dist.all_gather_object, gather_object, broadcast_object_list) on
the same gloo ranks: the same objects in the same places, for whole groups and a sub-group."""
import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives.objects import all_gather_object, broadcast_object, gather_object


def _object(rank):
    """A different object on every rank, of a different pickled length (padding), with tensors inside."""
    return {"rank": rank, "text": "x" * (3 + 1000 * rank), "none": None, "pair": (rank, [1.5, -rank]),
            "tensor": torch.arange(rank + 2, dtype=torch.float64) * (rank + 1), "empty": torch.empty(0, 3)}


def _plain(x):
    """Tensors as (dtype, shape, values): compared with ==, where a tensor's == would be elementwise."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.tolist())
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _compare():
    fanfold.distributed.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _object(rank)
    out = {}

    theirs = [None] * world
    dist.all_gather_object(theirs, mine)
    out["all_gather"] = (_plain(all_gather_object(mine)), _plain(theirs))

    last = world - 1
    theirs = [None] * world if rank == last else None
    dist.gather_object(mine, theirs, dst=last)
    out["gather"] = (_plain(gather_object(mine, dst=last)), _plain(theirs))

    theirs = [mine]
    dist.broadcast_object_list(theirs, src=last)
    out["broadcast"] = (_plain(broadcast_object(mine, src=last)), _plain(theirs[0]))

    # a sub-group of the last two ranks: dst and src are ranks in it, torch's are global ranks
    sub = dist.new_group([world - 2, world - 1])
    if rank >= world - 2:
        theirs = [None] * 2
        dist.all_gather_object(theirs, mine, group=sub)
        out["sub_all_gather"] = (_plain(all_gather_object(mine, group=sub)), _plain(theirs))
        theirs = [None] * 2 if rank == world - 2 else None
        dist.gather_object(mine, theirs, dst=world - 2, group=sub)
        out["sub_gather"] = (_plain(gather_object(mine, dst=0, group=sub)), _plain(theirs))
        theirs = [mine]
        dist.broadcast_object_list(theirs, src=world - 1, group=sub)
        out["sub_broadcast"] = (_plain(broadcast_object(mine, src=1, group=sub)), _plain(theirs[0]))

    errors = []
    for call in (lambda: gather_object(mine, dst=world), lambda: broadcast_object(mine, src=-1),
                 lambda: gather_object(mine, dst=True)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    fanfold.distributed.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_object_collectives_match_torchs(world):
    results = fanfold.launch(_compare, nprocs=world, timeout=120)
    for rank, out in enumerate(results):
        keys = ["all_gather", "gather", "broadcast"] + (["sub_all_gather", "sub_gather", "sub_broadcast"]
                                                        if rank >= world - 2 else [])
        for key in keys:
            ours, torchs = out[key]
            assert ours == torchs, (rank, key)
        assert out["all_gather"][0] == [_plain(_object(r)) for r in range(world)]
        assert out["gather"][0] == (None if rank < world - 1 else [_plain(_object(r)) for r in range(world)])
        assert out["broadcast"][0] == _plain(_object(world - 1))
        assert out["errors"] == [f"dst={world} is not a rank of the group (0..{world - 1})",
                                 f"src=-1 is not a rank of the group (0..{world - 1})",
                                 f"dst=True is not a rank of the group (0..{world - 1})"]
