"""Part of a model on the CPU, part on the GPU: the notes' example, as a ``fanfold.Pipeline``.

The notes end with a model split by hand: an ``nn.Embedding(1000, 10)`` on the CPU, an ``nn.Linear(10, 10)`` on
``cuda:0``, and ``x.to(device)`` in ``forward``. (Their code passes the layers as keyword arguments to
``nn.Module.__init__``, which raises TypeError; and split by hand, one device always waits for the other.) Here the
same two layers are an ``nn.Sequential``, and the pipeline runs them on micro-batches, so the CPU embeds micro-batch
m + 1 while the GPU works on micro-batch m:

    pipe = fanfold.Pipeline(nn.Sequential(nn.Embedding(1000, 10), nn.Linear(10, 10)),
                            balance=[1, 1], devices=["cpu", "cuda:0"], chunks=4)

Run it (from the repository root):

    python examples/model_split.py                          # cpu + cuda:0 with a GPU, cpu + cpu without
    python examples/model_split.py --devices cpu cpu        # both stages on the CPU, one thread each
    python examples/model_split.py --schedule gpipe --chunks 8 --steps 100
    fanfold run -n 2 examples/model_split.py                # one stage per process (DistributedPipeline)

Under ``fanfold run -n 2`` (or torchrun) each process runs one stage: rank 0 the embedding on the first device,
rank 1 the linear layer on the second, activations and gradients exchanged over gloo. The task: predict each
token's id modulo 10, with Adam. The script checks its own result and exits non-zero when a
check fails: the loss falls, and the trained weights equal those of the notes' hand-split model (fixed) trained on
the same batches with a plain ``loss.backward()``.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fanfold


class HandSplit(nn.Module):
    """The notes' model, written so it runs: the embedding on the CPU, the linear layer on ``device``."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.embedding = nn.Embedding(1000, 10)
        self.rnn = nn.Linear(10, 10).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embedding(x)  # on the CPU
        x = x.to(self.device)  # to the GPU
        return self.rnn(x)  # on the GPU


def batch(step: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 1000, (size, seq), generator=g)
    return tokens, tokens % 10


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).to(logits.device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ["cpu", "cuda:0"] if torch.cuda.is_available() else ["cpu", "cpu"]
    parser.add_argument("--devices", nargs=2, default=default, help=f"the two stages' devices (default {default})")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # set by fanfold run / torchrun: one stage per process
    if distributed:
        # gloo: the CPU stage's activations travel through host memory; no device is pinned per rank (one GPU is
        # enough: only rank 1 uses it)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        if dist.get_world_size() != 2:
            raise SystemExit(f"run with 2 processes (one per stage), not {dist.get_world_size()}")
    main_process = not distributed or dist.get_rank() == 0

    torch.manual_seed(0)
    reference = HandSplit(torch.device(args.devices[1]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 10), nn.Linear(10, 10))  # the same weights, as a sequence of layers
    if distributed:
        rank = dist.get_rank()
        pipe = fanfold.DistributedPipeline(model, balance=[1, 1], chunks=args.chunks, device=args.devices[rank])
        where = "one stage per process"
    else:
        pipe = fanfold.Pipeline(model, balance=[1, 1], devices=args.devices, chunks=args.chunks)
        where = "one process"
    if main_process:
        print(f"{args.devices[0]} + {args.devices[1]}, {args.chunks} micro-batches, {args.schedule}, {where}",
              flush=True)

    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)  # under fanfold run: this rank's stage only
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        tokens, target = batch(step, args.batch_size, 12)
        opt.zero_grad()
        # both stages busy at once; one stage per process, the first uses the tokens and the last the target
        loss = pipe.train_step(tokens, target, loss_fn, schedule=args.schedule)
        opt.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        loss_fn(reference(tokens), target).backward()  # the hand-split model: one device at a time
        ref_opt.step()
        if main_process and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)

    failures = []
    if not losses[-1] < 0.5 * losses[0]:
        failures.append(f"the loss did not fall enough: {losses[0]:.4f} -> {losses[-1]:.4f}")
    mine = {id(p) for p in pipe.parameters()}  # one stage per process: this rank trained its own layers only
    pairs = [(a, b) for a, b in [(model[0].weight, reference.embedding.weight), (model[1].weight, reference.rnn.weight),
                                 (model[1].bias, reference.rnn.bias)] if id(a) in mine]
    gap = max((a.detach().cpu() - b.detach().cpu()).abs().max().item() for a, b in pairs)
    if gap > 1e-4:
        failures.append(f"the weights differ from the hand-split model's by up to {gap:.3g}")
    failed = torch.tensor([float(len(failures))])
    if distributed:
        dist.all_reduce(failed)  # every rank learns the verdict, so all of them exit the same way
        dist.destroy_process_group()
    if failed.item() and not failures:
        failures.append("another rank's check failed")
    if main_process:
        print("FAILED: " + "; ".join(failures) if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
