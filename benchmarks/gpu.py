"""GPU evidence: fanfold against torch, DataParallel and DDP, on the CUDA devices present -> docs/gpu.md.

    .venv/bin/python benchmarks/gpu.py --with-tests   # or: make gpu-check (pytest -m gpu, then this)
    .venv/bin/python benchmarks/gpu.py --quick        # few steps: checks the set-up, writes the page all the same
    .venv/bin/python benchmarks/gpu.py --smoke-cpu    # the same code on 2 CPU "devices", tiny sizes, no page

Without CUDA it prints why and exits with status 1, leaving docs/gpu.md as it is (``--smoke-cpu`` runs every code
path on the CPU instead, to check the script itself on a machine without a GPU; its figures mean nothing).

What it measures, each row checked against an oracle (TF32 off throughout, so that float32 results computed with
different batch splits compare at 1e-4):

- DataParallel, one process: a training step (forward, backward, SGD) of an MLP (2048 -> 4096 -> 2048, 16.8M
  parameters) at 256 samples per device, and a forward call of a tiny Linear(5, 2) (the per-call overhead). Rows: the
  bare module on the first GPU; torch.nn.DataParallel and fanfold.DataParallel on every GPU (with one GPU: on it
  alone, the wrapper's overhead); fanfold with two replicas on the first GPU (fanfold accepts repeated devices).
  The check: the outputs and parameter gradients of one step equal the bare module's.
- DDP, one process per GPU over NCCL (with one GPU: one rank, so the cost of DDP's hooks and of an all-reduce over
  one rank): the same MLP at 256 samples per rank. Rows: one process without DDP, torch's DDP, fanfold's DDP. The
  check: after 3 steps on shards of one global batch, each DDP's parameters equal those of one process after 3 steps
  on the whole batch.

Times are medians over the timed steps, each step ending with a synchronisation of every device.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fanfold

ROOT = Path(__file__).resolve().parents[1]
CHECK_STEPS = 3
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Setup:
    """Where and how big: ``count`` devices of ``kind`` ("cuda", or "cpu" for the smoke run), the MLP's widths and
    the samples per device. Crosses into the DDP worker processes."""
    kind: str
    count: int
    width: int = 2048
    hidden: int = 4096
    per_device: int = 256

    def device(self, i: int) -> torch.device:
        return torch.device(self.kind, i) if self.kind != "cpu" else torch.device("cpu")

    def mlp(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(self.width, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.width))

    def data(self, n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, self.width, generator=g), torch.randn(n, self.width, generator=g)

    def sync(self) -> None:
        """Wait for every device (torch.cuda.synchronize() alone waits for the current one only)."""
        if self.kind == "cuda":
            for i in range(self.count):
                torch.cuda.synchronize(i)


def timed(step: Callable[[], None], sync: Callable[[], None], warmup: int, steps: int) -> float:
    """Median seconds of ``step``, each call ending with ``sync()`` (waiting for the devices it uses)."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exact_math() -> None:
    """TF32 off (torch's default for matmuls, not for cuDNN): the checks compare float32 results computed with
    different batch splits, and the timings are of that same arithmetic."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# ---- DataParallel ---------------------------------------------------------------------------------------------
def dp_rows(setup: Setup) -> dict[str, Callable[[nn.Module], nn.Module]]:
    n, first = setup.count, setup.device(0)
    every = [setup.device(i) for i in range(n)]
    return {
        f"bare module, {first}": lambda m: m,
        f"torch.nn.DataParallel, {n} device(s)": lambda m: nn.DataParallel(m, device_ids=every),
        f"fanfold.DataParallel, {n} device(s)": lambda m: fanfold.DataParallel(m, device_ids=every),
        f"fanfold.DataParallel, 2 replicas on {first}": lambda m: fanfold.DataParallel(m, [first, first]),
    }


def dp_check(setup: Setup, wrap: Callable[[nn.Module], nn.Module]) -> float:
    """Largest difference to the bare module over the output and the parameter gradients of one step."""
    bare = setup.mlp().to(setup.device(0))
    model = copy.deepcopy(bare)
    wrapped = wrap(model)
    x, y = (t.to(setup.device(0)) for t in setup.data(setup.per_device * setup.count))
    outs = []
    for m in (bare, wrapped):
        out = m(x)
        nn.functional.mse_loss(out, y).backward()
        outs.append(out.detach())
    diffs = [(outs[0] - outs[1]).abs().max().item()]
    diffs += [(p.grad - q.grad).abs().max().item() for p, q in zip(bare.parameters(), model.parameters(), strict=True)]
    return max(diffs)


def dp_measure(setup: Setup, warmup: int, steps: int) -> list[dict]:
    results = []
    first = setup.device(0)
    tiny_x = torch.randn(30, 5, device=first)
    x, y = (t.to(first) for t in setup.data(setup.per_device * setup.count))
    for name, wrap in dp_rows(setup).items():
        diff = dp_check(setup, wrap)
        model = setup.mlp().to(first)
        wrapped = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def train_step() -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()

        tiny = wrap(nn.Linear(5, 2).to(first))
        with torch.no_grad():
            call = timed(lambda: tiny(tiny_x), setup.sync, warmup * 10, steps * 10)
        step = timed(train_step, setup.sync, warmup, steps)
        results.append({"row": name, "step_ms": 1e3 * step, "call_us": 1e6 * call, "max_diff": diff})
        print(f"DataParallel  {name:45s} step {1e3 * step:8.2f} ms  call {1e6 * call:8.1f} us  max diff {diff:.2e}",
              file=sys.stderr, flush=True)
    return results


# ---- DDP (one process per device) -----------------------------------------------------------------------------
def ddp_worker(setup: Setup, kind: str, warmup: int, steps: int) -> dict:
    """In each rank: ``CHECK_STEPS`` steps on this rank's shard of a global batch for ``setup.count`` ranks (rank 0
    returns its parameters for the check), then the timed steps. ``kind``: "torch" or "fanfold" (DDP), or "none":
    one process without DDP, which takes the whole global batch when checking."""
    fanfold.distributed.init_process_group()  # NCCL with CUDA (this rank's GPU made current), else gloo
    device = setup.device(fanfold.distributed.local_rank())
    rank = dist.get_rank()
    exact_math()
    model = setup.mlp().to(device)
    ids = None if device.type == "cpu" else [device]  # torch's DDP takes no device_ids for a CPU module
    wrapped = {"none": lambda m: m,
               "torch": lambda m: nn.parallel.DistributedDataParallel(m, device_ids=ids),
               "fanfold": lambda m: fanfold.DistributedDataParallel(m, device_ids=ids)}[kind](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per = setup.per_device
    for step in range(CHECK_STEPS):
        x, y = setup.data(per * setup.count, seed=100 + step)
        if kind != "none":
            x, y = x[rank * per: (rank + 1) * per], y[rank * per: (rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(wrapped(x.to(device)), y.to(device)).backward()
        opt.step()
    # a numpy array: pickled back to the parent as plain bytes, not as a shared-memory tensor
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
    x, y = (t.to(device) for t in setup.data(per))

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()

    def sync() -> None:  # this rank's device only: touching the others would give them a context in this process
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds = timed(train_step, sync, warmup, steps)
    wrapped = train_step = None  # torch's DDP goes before its group: destroying the group under it can hang
    dist.destroy_process_group()
    return {"seconds": seconds, "params": params if rank == 0 else None}


def ddp_measure(setup: Setup, warmup: int, steps: int) -> list[dict]:
    results, reference = [], None
    n = setup.count
    for kind, name in (("none", "one process, no DDP"), ("torch", f"torch DDP, {n} rank(s)"),
                       ("fanfold", f"fanfold DDP, {n} rank(s)")):
        # spawn: CUDA cannot be used in a child forked from a parent that has used it
        per_rank = fanfold.launch(ddp_worker, setup, kind, warmup, steps, nprocs=1 if kind == "none" else n,
                                  timeout=900, start_method="spawn")
        params = torch.from_numpy(per_rank[0]["params"])
        if reference is None:
            reference = params
        diff = (params - reference).abs().max().item()
        seconds = max(r["seconds"] for r in per_rank)  # the slowest rank sets the pace
        results.append({"row": name, "step_ms": 1e3 * seconds, "max_diff": diff})
        print(f"DDP  {name:50s} step {1e3 * seconds:8.2f} ms  max diff {diff:.2e}", file=sys.stderr, flush=True)
    return results


# ---- the page -------------------------------------------------------------------------------------------------
def run_gpu_tests() -> tuple[int, str]:
    """``pytest -m gpu``: its exit status and its closing summary line."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    print(proc.stdout[-5000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else f"(no output; exit {proc.returncode})"


def versions(setup: Setup) -> tuple[str, str]:
    """The devices, and torch's / CUDA's / cuDNN's / NCCL's versions, as the page shows them."""
    if setup.kind != "cuda":
        return f"{setup.count} x CPU (smoke run: no GPU)", f"torch {torch.__version__}"
    names = sorted({torch.cuda.get_device_name(i) for i in range(setup.count)})
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return (f"{setup.count} x " + ", ".join(names),
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")


def page(setup: Setup, args: argparse.Namespace, tests: tuple[int, str] | None, dp: list[dict],
         ddp: list[dict]) -> str:
    devices, stack = versions(setup)
    worst = max(r["max_diff"] for r in dp + ddp)
    params = sum(p.numel() for p in setup.mlp().parameters())
    lines = [
        "# GPU evidence",
        "",
        "Generated by `make gpu-check` (`benchmarks/gpu.py`); rerun it on a GPU machine to refresh.",
        "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; command: "
        f"`{' '.join(['benchmarks/gpu.py', *sys.argv[1:]])}`",
        f"- devices: {devices}",
        f"- {stack}",
        f"- {args.steps} timed steps after {args.warmup} warm-up steps per row; medians; TF32 off",
        "",
        "## Tests",
        "",
        f"`pytest -m gpu`: {tests[1]} (exit {tests[0]})" if tests else "`pytest -m gpu` not run (no `--with-tests`)",
        "",
        f"## Same results as the oracle: {'yes' if worst <= TOLERANCE else '**NO**'} (largest difference "
        f"{worst:.2e}, tolerance {TOLERANCE:g})",
        "",
        f"## DataParallel (one process; MLP of {params:,} parameters, {setup.per_device} samples per device)",
        "",
        "| row | train step (ms) | Linear(5, 2) forward call (us) | max difference to the bare module |",
        "| --- | --- | --- | --- |",
        *(f"| {r['row']} | {r['step_ms']:.2f} | {r['call_us']:.1f} | {r['max_diff']:.1e} |" for r in dp),
        "",
        f"## DDP (one process per device; same MLP, {setup.per_device} samples per rank)",
        "",
        f"| row | train step (ms, slowest rank) | max parameter difference to one process after {CHECK_STEPS} "
        "steps on the whole batch |",
        "| --- | --- | --- |",
        *(f"| {r['row']} | {r['step_ms']:.2f} | {r['max_diff']:.1e} |" for r in ddp),
        "",
    ]
    if setup.count == 1:
        lines += ["With one GPU the DataParallel rows measure the wrappers' overhead on that device, and the DDP "
                  "rows one rank: DDP's hooks and buckets plus an all-reduce over one rank, no communication.", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up: checks the set-up")
    p.add_argument("--with-tests", action="store_true", help="run `pytest -m gpu` first and report its result")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="run every code path on 2 CPU devices with tiny sizes; prints the page, writes none")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu.md")
    args = p.parse_args()
    if args.smoke_cpu:
        setup, args.steps, args.warmup = Setup("cpu", 2, width=16, hidden=32, per_device=8), 2, 1
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build: {torch.version.cuda}): nothing measured, {args.out} left as it "
              "is. Run `make gpu-check` on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 1
    else:
        setup = Setup("cuda", torch.cuda.device_count())
    if args.quick:
        args.steps, args.warmup = 3, 1
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    exact_math()
    tests = run_gpu_tests() if args.with_tests else None
    ddp = ddp_measure(setup, args.warmup, args.steps)
    dp = dp_measure(setup, args.warmup, args.steps)
    text = page(setup, args, tests, dp, ddp)
    if not args.smoke_cpu:
        args.out.write_text(text)
    print(text)
    bad = [r["row"] for r in dp + ddp if r["max_diff"] > TOLERANCE]
    if bad:
        print(f"benchmarks/gpu.py: FAILED: results differ from the oracle in {bad}", file=sys.stderr)
    if tests and tests[0] != 0:
        print("benchmarks/gpu.py: FAILED: `pytest -m gpu` did not pass", file=sys.stderr)
    return 1 if bad or (tests and tests[0] != 0) else 0


if __name__ == "__main__":
    # The DDP ranks start with spawn, which finds ddp_worker by module and name: run as the importable module
    # `gpu` (this file's folder is sys.path[0]), not as __main__, which a fresh process cannot import by name.
    sys.exit(importlib.import_module(Path(__file__).stem).main())
