"""fanfold.save / fanfold.load: exact resume (an uninterrupted run is the oracle), prefixes, integrity, safety."""
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fanfold
import fanfold.training.checkpoint as ckpt
from fanfold import CheckpointError
from fanfold.training.data import DistributedSampler


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _objects(seed):
    model = _net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=100)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=5)
    # Its own generator: a DataLoader draws a worker seed from its generator at every iter(), and a resumed run
    # starts one iter() more than an uninterrupted one; with the global generator that would shift every draw.
    return model, opt, sched, sampler, DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())


def _batches(loader):
    while True:
        yield from loader  # every new pass over the loader is the sampler's next epoch


def _steps(objs, batches, k):
    """k training steps; records each loss and a draw from each generator a training script might use."""
    model, opt, sched = objs[:3]
    log = []
    for _ in range(k):
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        log.append((loss.item(), torch.rand(2).tolist(), np.random.rand(), random.random(), y.tolist()))
    return log


def test_round_trip_resume_equals_uninterrupted_run(tmp_path):
    objs = _objects(0)
    batches = _batches(objs[4])
    _steps(objs, batches, 3)  # stop mid-epoch (5 steps per epoch)
    path = tmp_path / "c.pt"
    fanfold.save(path, {"model": objs[0], "optimizer": objs[1], "scheduler": objs[2], "sampler": objs[3],
                        "step": 3, "losses": [1.5, 2.5], "run": {"lr": 0.01, "name": "x", "shape": (2, None)}})
    ref = _steps(objs, batches, 8)  # crosses into the next epoch
    np.random.seed(123), random.seed(123), torch.manual_seed(123)  # a restarted process has other states

    fresh = _objects(seed=9)
    state = {"model": fresh[0], "optimizer": fresh[1], "scheduler": fresh[2], "sampler": fresh[3], "step": 0}
    plain = fanfold.load(path, state)
    assert plain == {"step": 3, "losses": [1.5, 2.5], "run": {"lr": 0.01, "name": "x", "shape": (2, None)}}
    got = _steps(fresh, _batches(fresh[4]), 8)
    assert got == ref  # losses bitwise, RNG draws, batch contents (sampler resumed mid-epoch)
    for a, b in zip(objs[0].state_dict().values(), fresh[0].state_dict().values()):
        assert torch.equal(a, b)
    assert fresh[2].state_dict() == objs[2].state_dict()


def test_file_is_plain_weights_only_torch_load_with_unprefixed_cpu_tensors(tmp_path):
    model = _net()
    wrapped = nn.DataParallel(torch.compile(model))  # both wrappers, no compilation needed
    assert next(iter(wrapped.state_dict())).startswith("module._orig_mod.")
    fanfold.save(tmp_path / "c.pt", {"model": wrapped, "step": 1})
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert list(raw["model"]) == list(model.state_dict())
    assert all(t.device.type == "cpu" for t in raw["model"].values())
    assert raw["step"] == 1 and raw["__fanfold__"]["world_size"] == 1
    model.load_state_dict(raw["model"])  # usable without fanfold


def test_fanfold_wrappers_are_unwrapped_both_ways(tmp_path):
    from fanfold.parallel.data_parallel import DataParallel

    src, dst = _net(1), _net(2)
    fanfold.save(tmp_path / "c.pt", {"model": DataParallel(torch.compile(src), device_ids=["cpu", "cpu"])})
    assert list(torch.load(tmp_path / "c.pt", weights_only=True)["model"]) == list(src.state_dict())
    fanfold.load(tmp_path / "c.pt", {"model": DataParallel(dst, device_ids=["cpu", "cpu"])})
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def _rename(sd, fn):
    return {fn(k): v for k, v in sd.items()}


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.compile(nn.Linear(4, 4))  # a compiled submodule: `body._orig_mod.weight`
        self.head = nn.Linear(4, 2)


@pytest.mark.parametrize("writer", ["dp", "compile", "dp+compile", "lightning", "plain"])
@pytest.mark.parametrize("reader", ["plain", "dp+compile"])
def test_foreign_prefixed_checkpoints_load_both_ways(tmp_path, writer, reader):
    src = _net(1)
    wrap = {"dp": nn.DataParallel, "compile": torch.compile, "plain": lambda m: m,
            "dp+compile": lambda m: nn.DataParallel(torch.compile(m)), "lightning": lambda m: m}[writer]
    sd = wrap(src).state_dict()
    if writer == "lightning":
        sd = _rename(sd, lambda k: "_forward_module." + k)
    torch.save(sd, tmp_path / "foreign.pt")  # written by someone else: a bare, prefixed state dict
    dst = _net(2)
    live = dst if reader == "plain" else nn.DataParallel(torch.compile(dst))
    assert fanfold.load(tmp_path / "foreign.pt", {"model": live}) == {}
    for a, b in zip(src.state_dict().values(), dst.state_dict().values()):
        assert torch.equal(a, b)


def test_compiled_submodule_and_named_entries_of_a_foreign_file(tmp_path):
    src, dst = _Tower(), _Tower()
    assert "body._orig_mod.weight" in src.state_dict()
    torch.save({"model": nn.DataParallel(src).state_dict(), "iter_num": 7}, tmp_path / "n.pt")  # nanoGPT style
    assert fanfold.load(tmp_path / "n.pt", {"model": dst}) == {"iter_num": 7}
    assert torch.equal(dst.body.weight, src.body.weight)
    fanfold.save(tmp_path / "f.pt", {"model": src})
    assert "body.weight" in torch.load(tmp_path / "f.pt", weights_only=True)["model"]


class _Holder(nn.Module):  # the user's own container: its `module.` keys are real names, not a wrapper's
    def __init__(self, seed):
        super().__init__()
        self.module = _net(seed)


def test_a_models_own_module_attribute_is_kept_on_save_and_matched_on_load(tmp_path):
    src = _Holder(1)
    fanfold.save(tmp_path / "h.pt", {"model": src})
    raw = torch.load(tmp_path / "h.pt", weights_only=True)["model"]
    assert list(raw) == list(src.state_dict())  # a plain load_state_dict still works
    bare = _net(2)
    fanfold.load(tmp_path / "h.pt", {"model": bare})
    assert all(torch.equal(a, b) for a, b in zip(src.module.state_dict().values(), bare.state_dict().values()))


def _params(m):
    return [p.detach().clone() for p in m.state_dict().values()]


def test_wrong_architecture_lists_keys_and_changes_nothing(tmp_path):
    fanfold.save(tmp_path / "c.pt", {"model": _net(), "step": 2})
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    before = _params(other)
    with pytest.raises(CheckpointError, match=r"c\.pt.*'model'.*missing keys \(2\): \['2\.weight'.*unexpected keys"
                                              r" \(\d+\): \['3\.weight'"):
        fanfold.load(tmp_path / "c.pt", {"model": other})
    wide = _net()
    wide[4] = nn.Linear(8, 5)
    with pytest.raises(CheckpointError, match=r"shape mismatches \(2\): \['4\.weight: saved \(3, 8\), model \(5, 8\)"):
        fanfold.load(tmp_path / "c.pt", {"model": wide})
    with pytest.raises(CheckpointError, match=r"has no entries \['optimizer'\]"):
        fanfold.load(tmp_path / "c.pt", {"model": _net(), "optimizer": torch.optim.SGD(_net().parameters(), 0.1)})
    assert all(torch.equal(a, b) for a, b in zip(before, _params(other)))


def test_optimizer_misfit_is_caught_before_the_model_is_touched(tmp_path):
    m = _net()
    fanfold.save(tmp_path / "c.pt", {"model": m, "optimizer": torch.optim.SGD(m.parameters(), 0.1)})
    live = _net(3)
    opt = torch.optim.SGD([{"params": list(live.parameters())[:2]}, {"params": list(live.parameters())[2:]}], 0.1)
    before = _params(live)
    with pytest.raises(CheckpointError, match=r"'optimizer': the optimizer has parameter groups of sizes \[2, 4\]"):
        fanfold.load(tmp_path / "c.pt", {"model": live, "optimizer": opt})
    assert all(torch.equal(a, b) for a, b in zip(before, _params(live)))


def test_refused_sampler_state_rolls_back_scheduler_and_rng(tmp_path):
    objs = _objects(0)
    fanfold.save(tmp_path / "c.pt", {"scheduler": objs[2], "sampler": objs[3]})
    live = _objects(1)
    live[1].step(), live[2].step()
    sched_before = live[2].state_dict()
    short = DistributedSampler(range(39), num_replicas=1, rank=0, seed=5)
    torch.manual_seed(3)
    expect = torch.rand(3)
    torch.manual_seed(3)
    with pytest.raises(CheckpointError, match=r"'sampler' refused by DistributedSampler: .*num_samples=40"):
        fanfold.load(tmp_path / "c.pt", {"scheduler": live[2], "sampler": short})
    assert live[2].state_dict() == sched_before
    assert torch.equal(torch.rand(3), expect)  # the saved RNG state was put back as well


def test_unsaveable_value_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"state\['run'\]\['when'\]: numpy.float64 cannot be saved"):
        fanfold.save(tmp_path / "c.pt", {"run": {"when": np.float64(1.0)}})
    assert not list(tmp_path.iterdir())  # nothing written, no temporary file left


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)  # would run while unpickling


def test_pickled_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": {"w": torch.ones(1)}, "step": _Evil(str(marker))}, tmp_path / "foreign.pt")
    # The same payload with a valid fanfold footer: an attacker can compute a checksum too.
    ckpt.write_atomic(tmp_path / "footed.pt", {"model": {"w": torch.ones(1)}, "__fanfold__": _Evil(str(marker))})
    for name in ("foreign.pt", "footed.pt"):
        with pytest.raises(CheckpointError, match=rf"{name}: refused: .*weights_only=True.*(posix|os)\.mkdir"):
            fanfold.load(tmp_path / name, {"model": nn.Linear(1, 1)})
        assert not marker.exists()


def _reference_file(tmp_path):
    m = _net()
    fanfold.save(tmp_path / "c.pt", {"model": m, "optimizer": torch.optim.Adam(m.parameters()), "step": 1})
    return (tmp_path / "c.pt").read_bytes()


def test_truncated_and_flipped_files_raise_naming_the_file(tmp_path):
    data = _reference_file(tmp_path)
    live = _net(4)
    before = _params(live)
    for label, bad in [("truncated", data[: len(data) // 2]), ("footer cut", data[:-48]), ("cut 10", data[:-10]),
                       ("flipped", data[:100] + bytes([data[100] ^ 1]) + data[101:]), ("empty", b"")]:
        (tmp_path / "bad.pt").write_bytes(bad)
        with pytest.raises(CheckpointError, match=r"bad\.pt: "):
            fanfold.load(tmp_path / "bad.pt", {"model": live}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(live)))


_FUZZ = {}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.one_of(st.none(), st.integers(0, 10**6)),
       flips=st.lists(st.tuples(st.one_of(st.integers(0, 10**6), st.integers(-64, -1)), st.integers(1, 255)),
                      max_size=3))
def test_fuzz_corruption_always_raises_checkpoint_error(tmp_path, cut, flips):
    if "data" not in _FUZZ:
        _FUZZ["data"] = _reference_file(tmp_path)
    data = bytearray(_FUZZ["data"])
    for pos, xor in flips:
        data[pos if pos < 0 else pos % len(data)] ^= xor  # negative: the footer and the zip directory
    if cut is not None:
        data = data[: cut % len(data)]
    if bytes(data) == _FUZZ["data"]:
        return
    path = tmp_path / "fuzz.pt"
    path.write_bytes(bytes(data))
    live = _net(4)
    opt = torch.optim.Adam(live.parameters())
    before = _params(live)
    with pytest.raises(CheckpointError, match=r"fuzz\.pt"):
        fanfold.load(path, {"model": live, "optimizer": opt, "step": 0})
    assert all(torch.equal(a, b) for a, b in zip(before, _params(live))) and not opt.state


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    fanfold.save(path, {"model": _net(1), "step": 1})
    real = torch.save

    def half_then_fail(payload, file):
        import io
        buf = io.BytesIO()
        real(payload, buf)
        file.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        fanfold.save(path, {"model": _net(2), "step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # the temporary file is gone
    live = _net(3)
    assert fanfold.load(path, {"model": live, "step": 0}) == {"step": 1}
    assert torch.equal(live[0].weight, _net(1)[0].weight)


_WRITER = """
import sys, torch, fanfold
model = torch.nn.Linear(1024, 2048)
step = 0
while True:
    step += 1
    with torch.no_grad():
        model.weight.fill_(step); model.bias.fill_(step)
    fanfold.save(sys.argv[1], {"model": model, "step": step})
    print(step, flush=True)
"""


def test_process_killed_while_writing_leaves_a_whole_checkpoint(tmp_path):
    path = tmp_path / "c.pt"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # let it finish a few checkpoints (each ~8 MB), then kill it wherever it is
            assert proc.stdout.readline(), "writer died"
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    live = torch.nn.Linear(1024, 2048)
    step = fanfold.load(path, {"model": live, "step": 0})["step"]
    assert step >= 3 and bool((live.weight == step).all()) and bool((live.bias == step).all())
    assert ckpt.latest(tmp_path) == path  # a leftover temporary file is never picked


def _two_ranks(tmp):
    import fanfold.training.checkpoint as C

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    writes = []
    real_write = C.write_atomic
    C.write_atomic = lambda p, payload: (writes.append(str(p)), real_write(p, payload))[1]
    model = nn.parallel.DistributedDataParallel(_net(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(range(20), seed=4)
    it = iter(sampler)
    [next(it) for _ in range(3)]
    model(torch.randn(6, 4) + rank).sum().backward()
    opt.step()
    torch.manual_seed(100 + rank), random.seed(rank), np.random.seed(rank)
    path = Path(tmp) / "c.pt"
    state = {"model": model, "optimizer": opt, "sampler": sampler, "step": 1}
    fanfold.save(path, state)
    if rank == 0:
        torch.save(model.state_dict(), Path(tmp) / "ddp.pt")  # torch DDP's own `module.` keys
    dist.barrier()
    expect = (torch.rand(3), random.random(), np.random.rand())
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    plain = fanfold.load(path, {**state, "step": 0})
    after = (torch.rand(3), random.random(), np.random.rand())
    loaded = model.module.state_dict()  # rank 0's state on every rank (BatchNorm statistics differed per rank)
    errors = []
    try:  # rank 1 asks for a missing entry: every rank must raise, none may hang
        fanfold.load(path, {"model": model, **({"nope": 1} if rank == 1 else {})})
    except CheckpointError as exc:
        errors.append(str(exc))
    try:
        fanfold.save(path, {"bad": object()})
    except (TypeError, RuntimeError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    return writes, expect, after, loaded, plain, errors, saved


def test_two_ranks_only_rank0_writes_and_each_rank_resumes_its_rng(tmp_path):
    res = fanfold.launch(_two_ranks, str(tmp_path), nprocs=2, timeout=180)
    assert [r[0] for r in res] == [[str(tmp_path / "c.pt")], []]
    for writes, expect, after, loaded, plain, errors, _ in res:
        assert torch.equal(expect[0], after[0]) and expect[1:] == after[1:]
        assert all(torch.equal(v, res[0][6][k]) for k, v in loaded.items()) and plain == {"step": 1}
    assert not torch.equal(res[0][1][0], res[1][1][0])  # per-rank states, not one copied to all
    assert "has no entries ['nope']" in res[1][5][0] and "rank 1 failed" in res[0][5][0]
    assert res[0][5][1].startswith("TypeError: state['bad']") and "rank 0 failed to write" in res[1][5][1]
    # the failed save left the file intact
    assert fanfold.load(tmp_path / "c.pt", {"step": 0}, rng=False) == {"step": 1}

    # Another world size (1 process here): model, optimizer and sampler load; RNG stays, with a warning.
    model = _net(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(range(20), num_replicas=1, rank=0, seed=4)
    torch.manual_seed(11)
    draw = torch.rand(2)
    torch.manual_seed(11)
    with pytest.warns(UserWarning, match="saved by 2 ranks, this run has 1: RNG states not restored"):
        fanfold.load(tmp_path / "c.pt", {"model": model, "optimizer": opt, "sampler": sampler})
    assert torch.equal(torch.rand(2), draw)  # this process's generator was left alone
    assert all(torch.equal(v, res[0][6][k]) for k, v in model.state_dict().items())
    raw = torch.load(tmp_path / "c.pt", weights_only=True)["optimizer"]["state"]
    assert len(opt.state) == len(raw) == 6 and sampler.state_dict()["consumed"] == 6
    assert all(torch.equal(opt.state[p]["momentum_buffer"], raw[i]["momentum_buffer"])
               for i, p in enumerate(model.parameters()))
    got = list(sampler)
    trained = [i for r in range(2) for i in list(DistributedSampler(range(20), 2, r, seed=4))[:3]]
    assert len(got) == 14 and sorted(got + trained) == list(range(20))  # the rest of the epoch, each sample once

    # torch DDP's own file, `module.` prefixed, loads into a bare model.
    bare = _net(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fanfold.load(tmp_path / "ddp.pt", {"model": bare})
    assert all(torch.equal(v, res[0][6][k]) for k, v in bare.state_dict().items())


def test_latest_picks_newest_complete_checkpoint(tmp_path):
    assert ckpt.latest(tmp_path / "missing") is None and ckpt.latest(tmp_path) is None
    fanfold.save(tmp_path / "a.pt", {"step": 1})
    time.sleep(0.01)
    fanfold.save(tmp_path / "b.pt", {"step": 2})
    assert ckpt.latest(tmp_path) == tmp_path / "b.pt"
    time.sleep(0.01)
    (tmp_path / "c.pt").write_bytes((tmp_path / "b.pt").read_bytes()[:-5])  # newest, but incomplete
    assert ckpt.latest(tmp_path) == tmp_path / "b.pt"


def test_a_checkpoint_cut_in_half_is_called_truncated(tmp_path):
    # issue 28: the refusal read "not a readable torch checkpoint ... (OSError: [Errno 22] Invalid argument)"
    data = _reference_file(tmp_path)
    (tmp_path / "bad.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"bad\.pt: truncated or corrupted: it begins as a torch checkpoint"):
        fanfold.load(tmp_path / "bad.pt", {"model": _net(4)}, strict=False)
