"""Peak resident memory of a rank, torch's DDP against fanfold's, on benchmarks/ddp.py's 16.7M-parameter MLP.

    .venv/bin/python benchmarks/ddp_memory.py                 # 3 launches per DDP, 5 steps each
    PYTHONPATH=/path/to/other/src .venv/bin/python benchmarks/ddp_memory.py   # another version of fanfold

Each launch (2 ranks x 1 thread, gloo; fanfold's DDP on its default transport) wraps one fresh copy of the model in
one DDP, trains ``--steps`` SGD steps (``zero_grad(set_to_none=True)``) and reads every rank's high-water mark of
resident memory (``VmHWM``), and the same before wrapping. The DDPs run in separate launches, alternating, because a
high-water mark cannot be told apart between two models in one process. Checked: both DDPs end with the same
parameters (rtol 1e-5), or the benchmark exits naming the launch.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp  # noqa: E402  (benchmarks/ddp.py: the model)

import fanfold  # noqa: E402

ROWS = ("torch DDP", "fanfold DDP")


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def one_launch(row: str, steps: int) -> dict:
    """In each worker: the high-water marks (MiB) before wrapping and after ``steps`` steps; a parameter sample."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    model, (x, y) = ddp.build("mlp")
    before = _hwm_mib()
    net = nn_ddp(model) if row == ROWS[0] else fanfold.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    for _ in range(steps):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = _hwm_mib()
    sample = torch.cat([p.detach().reshape(-1)[:1000] for p in model.parameters()])
    del net
    dist.destroy_process_group()
    return {"before": before, "after": after, "sample": sample}


def nn_ddp(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=3, help="launches per DDP (alternating)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    peaks: dict[str, list[float]] = {row: [] for row in ROWS}
    growth: dict[str, list[float]] = {row: [] for row in ROWS}
    reference = None
    for k in range(args.launches):
        for row in ROWS if k % 2 == 0 else ROWS[::-1]:
            ranks = fanfold.launch(one_launch, row, args.steps, nprocs=2, threads=1, timeout=300)
            reference = ranks[0]["sample"] if reference is None else reference
            if not all(torch.allclose(r["sample"], reference, rtol=1e-5, atol=1e-7) for r in ranks):
                raise SystemExit(f"launch {k + 1}, {row}: parameters differ from the first launch's")
            peaks[row] += [r["after"] for r in ranks]
            growth[row] += [r["after"] - r["before"] for r in ranks]
            print(f"launch {k + 1} {row:12s}: peak " + ", ".join(f"{r['after']:.0f}" for r in ranks) + " MiB",
                  file=sys.stderr, flush=True)
    print(f"fanfold {fanfold.__file__}; {args.launches} launches per DDP x 2 ranks, {args.steps} steps\n")
    print("| DDP | peak RSS a rank (MiB), median [range] | growth from wrapping on (MiB), median |")
    print("|---|---|---|")
    for row in ROWS:
        print(f"| {row} | {statistics.median(peaks[row]):.0f} [{min(peaks[row]):.0f}-{max(peaks[row]):.0f}] | "
              f"{statistics.median(growth[row]):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
