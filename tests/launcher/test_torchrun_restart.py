"""torchrun ``--max-restarts 1`` on a script ported to fanfold, one worker SIGKILLed in the first round: the job
restarts, resumes from its checkpoint and ends with the parameters of a one-process run (plain torch), or fails
with a message; it never hangs.

torchrun's workers share its agent's store across rounds, so the restarted round is made to read the store early:
rank 1 comes late to ``init_process_group``, and rank 0 finds whatever round 0 left there (gloo's addresses among
it). Round 1 also checks that a key round 0 wrote in its default store is gone.

``FANFOLD_TORCHRUN_RUNS=N`` repeats each case N times (default 1); each run takes ~30-60 s on 2 busy cores.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

SRC = str(Path(__file__).resolve().parents[2] / "src")
RUNS = int(os.environ.get("FANFOLD_TORCHRUN_RUNS", "1"))
STALL_S = 60  # the script's init_process_group timeout: a wait in gloo's connect ends by then, with a message
BOUND_S = 300  # the whole torchrun job, both rounds, on a busy machine; beyond it, it hung
EPOCHS, SAMPLES, BATCH, KILLED_AFTER = 4, 64, 8, 2  # rank 1 dies after the checkpoint of epoch KILLED_AFTER

SCRIPT = textwrap.dedent(f"""
    import json, os, signal, sys, time
    import torch, torch.nn.functional as F
    import torch.distributed as dist
    from torch import nn
    import fanfold, fanfold.distributed

    workdir = sys.argv[1]
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if attempt == 1 and rank == 1:
        time.sleep(2.0)  # late: rank 0 reads the shared store before rank 1 writes to it
    fanfold.distributed.init_process_group(timeout={STALL_S})
    store = dist.distributed_c10d._get_default_store()
    if attempt == 0 and rank == 0:
        store.set("written-in-round-0", "1")
    stale = attempt > 0 and store.check(["written-in-round-0"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = fanfold.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn({SAMPLES}, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn({SAMPLES}, 1, generator=torch.Generator().manual_seed(2))
    sampler = fanfold.DistributedSampler(torch.utils.data.TensorDataset(x, y), seed=3)
    ckpt = os.path.join(workdir, "ckpt.pt")
    start = fanfold.load(ckpt, {{"model": ddp, "opt": opt}})["epoch"] if os.path.exists(ckpt) else 0
    with open(os.path.join(workdir, f"attempt{{attempt}}.rank{{rank}}.json"), "w") as f:
        json.dump({{"stale": stale, "start": start}}, f)
    for epoch in range(start, {EPOCHS}):
        sampler.set_epoch(epoch)
        for idx in torch.utils.data.BatchSampler(sampler, {BATCH}, drop_last=False):
            loss = F.mse_loss(ddp(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        fanfold.save(ckpt, {{"model": ddp, "opt": opt, "epoch": epoch + 1}})
        if attempt == 0 and rank == 1 and epoch + 1 == {KILLED_AFTER}:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], os.path.join(workdir, "final.pt"))
    fanfold.distributed.destroy_process_group()
""")


def one_process_parameters() -> list[torch.Tensor]:
    """The oracle: plain torch, one process, each step on the union of the two ranks' batches (torch's
    DistributedSampler order: rank r takes the epoch's permutation from position r, every 2nd)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(SAMPLES, 1, generator=torch.Generator().manual_seed(2))
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(3 + epoch))
        for k in range(0, SAMPLES, 2 * BATCH):
            idx = order[k:k + 2 * BATCH]
            loss = F.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (torchrun's workers run in sessions of their own)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parents.items() if pp in frontier]
        found += children
        frontier = children
    return found


def _torchrun(workdir: Path, env: dict) -> tuple[int | None, str, float]:
    """(exit code or None if it hung, output, seconds); a job still running after BOUND_S is killed whole."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1",
           str(workdir / "job.py"), str(workdir)]
    began = time.monotonic()
    with open(workdir / "out.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            code = None
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        log.seek(0)
        return code, log.read(), time.monotonic() - began


@pytest.mark.slow
@pytest.mark.timeout(BOUND_S * RUNS + 120)
@pytest.mark.parametrize("store", ["torchrun", "secret"])
def test_torchrun_restart_after_a_killed_worker_finishes_like_one_process(tmp_path, store):
    expected = one_process_parameters()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    if store == "secret":  # fanfold's authenticated store, its address put in torchrun's
        env["FANFOLD_JOB_SECRET"] = secrets.token_hex(32)
    verdicts = []
    for run in range(RUNS):
        workdir = tmp_path / f"run{run}"
        workdir.mkdir()
        (workdir / "job.py").write_text(SCRIPT)
        code, out, seconds = _torchrun(workdir, env)
        tail = out[-3000:]
        assert code is not None, f"run {run}: torchrun still running after {BOUND_S} s (hung), killed:\n{tail}"
        assert code == 0, f"run {run}: torchrun exited {code} after {seconds:.0f} s:\n{tail}"
        reports = {p.name: json.loads(p.read_text()) for p in workdir.glob("attempt*.json")}
        assert set(reports) == {f"attempt{a}.rank{r}.json" for a in (0, 1) for r in (0, 1)}, (sorted(reports), tail)
        assert [reports[f"attempt1.rank{r}.json"] for r in (0, 1)] == [{"stale": False, "start": KILLED_AFTER}] * 2
        final = torch.load(workdir / "final.pt")
        for got, want in zip(final, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        verdicts.append(round(seconds))
    print(f"{store}: {len(verdicts)} of {RUNS} runs restarted and finished, seconds {verdicts}")
