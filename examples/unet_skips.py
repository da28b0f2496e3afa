"""A small U-Net, split over 2-4 pipeline stages, with its skip connections carried between the stages.

A U-Net's decoder concatenates each upsampled map with the encoder's map of the same size: a skip connection from
an early layer to a late one, which may sit on another stage. Written as one ``nn.Sequential``, the encoder's
``Stash(name)`` keeps the map it passes on, and the decoder's ``Pop(stash)`` concatenates it (along the channels) to
its own input:

    down1 = Stash("down1")
    model = nn.Sequential(conv(3, 8), down1, nn.MaxPool2d(2), ..., nn.Upsample(scale_factor=2), Pop(down1), ...)
    pipe = fanfold.Pipeline(model, balance, ["cpu"] * 3, chunks=4, checkpoint="except_last")

Run it (from the repository root):

    python examples/unet_skips.py                    # 2, 3 and 4 stages on CPU threads
    python examples/unet_skips.py --stages 3 --chunks 8 --checkpoint always

The script checks its own result and exits non-zero when a check fails: for each number of stages, the pipeline's
output, loss and gradients (``pipe(x)`` with ``loss.backward()``, and ``train_step`` under both schedules) equal
the unsplit ``nn.Sequential``'s on the whole batch, in float64.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

import fanfold
from fanfold.pipeline import Pop, Stash


def conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.Tanh())


def unet(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    down1, down2 = Stash("down1"), Stash("down2")
    return nn.Sequential(
        conv(3, 8), down1, nn.MaxPool2d(2),                                 # 16x16 -> 8x8, keeps the 16x16 map
        conv(8, 16), down2, nn.MaxPool2d(2),                                # 8x8 -> 4x4, keeps the 8x8 map
        conv(16, 16),                                                       # the bottom
        nn.Upsample(scale_factor=2), Pop(down2), conv(32, 8),              # 8x8, with the encoder's 16 channels
        nn.Upsample(scale_factor=2), Pop(down1), conv(16, 8),              # 16x16, with the encoder's 8 channels
        nn.Conv2d(8, 2, 1),
    ).double()


BALANCES = {2: [6, 8], 3: [3, 5, 6], 4: [2, 4, 4, 4]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4], choices=sorted(BALANCES))
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--checkpoint", default="except_last", choices=["never", "except_last", "always"])
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 3, 16, 16, generator=g, dtype=torch.float64)
    target = torch.randn(10, 2, 16, 16, generator=g, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    ref = unet()
    ref_out = ref(x)
    ref_loss = loss_fn(ref_out, target)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    failures = []
    for stages in args.stages:
        pipe = fanfold.Pipeline(copy.deepcopy(unet()), BALANCES[stages], ["cpu"] * stages, chunks=args.chunks,
                                checkpoint=args.checkpoint)
        out = pipe(x)
        loss = loss_fn(out, target)
        loss.backward()
        runs = [("pipe(x) + backward", out, loss)]
        grads = [{n: p.grad.clone() for n, p in pipe.named_parameters()}]
        for schedule in ("gpipe", "1f1b"):
            pipe.zero_grad(set_to_none=True)
            runs.append((f"train_step {schedule}", None, pipe.train_step(x, target, loss_fn, schedule=schedule)))
            grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        for (what, o, lo), gr in zip(runs, grads):
            ok = (o is None or torch.allclose(o, ref_out)) and torch.allclose(lo, ref_loss) and \
                gr.keys() == ref_grads.keys() and all(torch.allclose(gr[n], ref_grads[n]) for n in ref_grads)
            print(f"{stages} stages {BALANCES[stages]}, {what}: loss {float(lo.detach()):.6f} "
                  f"{'equals' if ok else 'DIFFERS from'} the unsplit model's")
            if not ok:
                failures.append((stages, what))
        pipe.close()
    if failures:
        print(f"FAILED: {failures}", file=sys.stderr)
        return 1
    print("the split U-Net equals the unsplit one: outputs, losses and gradients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
