"""DistributedDataParallel step time, side by side: one process, torch's DDP and fanfold's DDP (gloo, CPU).

    .venv/bin/python benchmarks/ddp.py                       # 3 runs x 20 steps, both models (several minutes)
    .venv/bin/python benchmarks/ddp.py --quick               # 2 runs x 3 steps: a smoke test of the set-up
    .venv/bin/python benchmarks/ddp.py --models mlp --runs 5 --steps 30 --transport shm --hook bf16

Models: a 16.7M-parameter MLP (batch 64 per rank) and a 7.4M-parameter transformer LM (8 x 128 tokens per rank,
tied embeddings). Rows, at the same batch per rank: one process with 1 and 2 threads; 2 ranks x 1 thread without
gradient sync (each rank trains alone: the compute floor, so the gap to it bounds what communication costs);
torch DDP and fanfold DDP, 2 ranks x 1 thread, same optimizer and data. Every rank of every row starts from the same
seed. A run is one fresh launch (``fanfold.launch``) of warm-up steps then ``--steps`` timed steps (forward,
backward, SGD step); its time is the slowest rank's mean step time; the table shows the median over ``--runs``,
with the rows interleaved within each run so that load from other programs falls on all of them alike.
"CPU per step and process" is the CPU time of one rank's process (all its threads, so DDP's communication thread
too) per timed step, averaged over the ranks: on cores that all compute, whatever the exchange costs shows there.
Efficiency = samples/s / (ranks x threads x samples/s of 1 process x 1 thread): 1.0 is perfect scaling over the
cores used; for the DDP rows it is the issue's 2-rank throughput / (2 x 1-rank throughput).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fanfold

# row name -> (ranks, threads per rank)
ROWS = {
    "1 process, 1 thread": (1, 1),
    "1 process, 2 threads": (1, 2),
    "2 ranks, no gradient sync": (2, 1),
    "torch DDP": (2, 1),
    "fanfold DDP": (2, 1),
}


class TinyLM(nn.Module):
    """GPT-style: token + position embeddings, 8 pre-norm causal layers (d=256, 4 heads), head tied to the tokens."""

    def __init__(self, vocab: int = 4096, d: int = 256, layers: int = 8, context: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.norm(self.blocks(h, mask=self.mask[:t, :t], is_causal=True))
        return h @ self.tok.weight.t()


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model and one batch of its per-rank size (synthetic: the data does not change the step time)."""
    torch.manual_seed(0)
    if name == "mlp":
        widths = [1024, 2048, 2048, 2048, 2048]
        layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
        model = nn.Sequential(*layers, nn.Linear(2048, 1000))
        return model, (torch.randn(64, 1024), torch.randint(0, 1000, (64,)))
    tokens = torch.randint(0, 4096, (8, 129))
    return TinyLM(), (tokens[:, :-1], tokens[:, 1:])


def _wrap(row: str, model: nn.Module, transport: str | None, hook: str | None) -> nn.Module:
    if row == "torch DDP":
        ddp = nn.parallel.DistributedDataParallel(model)
        if hook == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            # torch refuses its bf16_compress_hook by name without NCCL; gloo sums bf16 fine on the CPU.
            def torch_bf16_hook(state, bucket):
                return bf16_compress_hook(state, bucket)

            ddp.register_comm_hook(dist.group.WORLD, torch_bf16_hook)
        return ddp
    if transport == "shm-no-peer-read":
        from fanfold.collectives import ShmTransport

        transport = ShmTransport(peer_read=False)
    ddp = fanfold.DistributedDataParallel(model, **({"transport": transport} if transport else {}))
    if hook == "bf16":
        ddp.register_comm_hook(None, fanfold.distributed.bf16_compress_hook)
    return ddp


def one_run(row: str, model_name: str, warmup: int, steps: int, transport: str | None,
            hook: str | None) -> tuple[float, int, float]:
    """In each worker: mean seconds per timed step on this rank, the model's parameter count, and the CPU seconds
    this rank's process (all its threads: DDP's communication included) used per timed step."""
    model, (x, y) = build(model_name)
    count = sum(p.numel() for p in model.parameters())
    sync = row in ("torch DDP", "fanfold DDP")
    if sync:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        model = _wrap(row, model, transport, hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    if sync:
        dist.barrier()  # start the clock together; DDP keeps the ranks in step from here on
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps, count, (time.process_time() - cpu) / steps


def measure(args: argparse.Namespace) -> dict:
    times: dict = {(m, r): [] for m in args.models for r in ROWS}
    args.cpu = {(m, r): [] for m in args.models for r in ROWS}  # mean over ranks of CPU seconds per step
    # The parent computes nothing: workers are forked from it (one_run lives in __main__), and a fork after torch
    # has started its OpenMP pool can hang the child's own.
    for run in range(args.runs):
        for model_name in args.models:
            for row, (ranks, threads) in ROWS.items():
                per_rank = fanfold.launch(one_run, row, model_name, args.warmup, args.steps, args.transport,
                                          args.hook, nprocs=ranks, threads=threads, timeout=args.timeout)
                slowest = max(t for t, *_ in per_rank)
                times[model_name, row].append(slowest)
                args.cpu[model_name, row].append(statistics.mean(c for *_, c in per_rank))
                args.params[model_name] = per_rank[0][1]
                print(f"run {run + 1}/{args.runs}  {model_name:3s}  {row:26s} {1e3 * slowest:8.1f} ms/step",
                      file=sys.stderr, flush=True)
    return times


def table(args: argparse.Namespace, times: dict) -> str:
    batch = {"mlp": 64, "lm": 8}
    unit = {"mlp": "samples", "lm": "sequences"}
    lines = ["| model | row | ranks x threads | step (ms, median) | CPU per step and process (ms, median) | "
             "throughput (/s) | efficiency | fanfold / torch |", "|---|---|---|---|---|---|---|---|"]
    for m in args.models:
        base = batch[m] / statistics.median(times[m, "1 process, 1 thread"])
        torch_t = statistics.median(times[m, "torch DDP"])
        for row, (ranks, threads) in ROWS.items():
            t = statistics.median(times[m, row])
            rate = ranks * batch[m] / t
            ratio = f"**{t / torch_t:.3f}**" if row == "fanfold DDP" else ""
            name = f"{'MLP' if m == 'mlp' else 'LM'} {args.params[m] / 1e6:.1f}M"
            cpu = 1e3 * statistics.median(args.cpu[m, row])
            lines.append(f"| {name} | {row} | {ranks} x {threads} | {1e3 * t:.1f} | {cpu:.1f} | {rate:.1f} {unit[m]} | "
                         f"{rate / (ranks * threads * base):.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm (default both)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, bucket rebuild)")
    p.add_argument("--quick", action="store_true", help="2 runs x 3 steps, 1 warm-up: checks the set-up only")
    p.add_argument("--transport", default=None,
                   help="passed to fanfold DDP: torch (gloo, as torch DDP) or shm (default: fanfold's own choice); "
                        "shm-no-peer-read: shm without reading the peers' memory (gradients copied into shared memory)")
    p.add_argument("--hook", choices=["bf16"], default=None, help="bf16 gradient compression in both DDPs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before giving up")
    args = p.parse_args()
    if args.quick:
        args.runs, args.steps, args.warmup = 2, 3, 1
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in ("mlp", "lm")]
    if bad or args.runs < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--models takes mlp and lm (got {bad}); --runs and --steps >= 1, --warmup >= 0")
    args.params = {}
    load = os.getloadavg()[0]
    times = measure(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {cores} cores, gloo; "
          f"{args.runs} runs x {args.steps} steps (+{args.warmup} warm-up); "
          f"transport={args.transport or 'default (select_transport)'}, "
          f"hook={args.hook or 'none'}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(table(args, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
