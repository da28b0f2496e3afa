"""``fanfold demo``: the classic DataParallel tutorial (``Linear(5, 2)`` on ``RandomDataset(5, 100)``, batches of 30),
on GPUs or CPU replicas: each replica prints its chunk's size, the loop the whole batch's, one locked ``tqdm.write``
a line. Sample output: docs/data-parallel.md, "Demo"."""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .._core.devices import default_device_ids, normalize_device
from ..parallel.data_parallel import DataParallel


class Model(nn.Module):
    """The tutorial's model: one linear layer that reports the sizes it sees."""

    def __init__(self, input_size: int, output_size: int, write: Callable[[str], None] = print) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)
        self.write = write

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = self.fc(input)
        self.write(f"  In Model: input size {input.size()} output size {output.size()}")
        return output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None,
                        help="replicas: N accelerators if there are at least N, else N CPU replicas "
                             "(default: every accelerator, or 2 CPU replicas)")
    parser.add_argument("--batch-size", type=int, default=30, help="rows per step, split over the replicas")
    parser.add_argument("--data-size", type=int, default=100, help="rows in the random dataset")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, the weights and the shuffle")


def _device_ids(n: int | None) -> list:
    accelerators = default_device_ids()
    if n is None:
        return accelerators or ["cpu", "cpu"]
    if n < 1:
        raise SystemExit(f"fanfold demo: --devices must be >= 1, got {n}")
    return accelerators[:n] if len(accelerators) >= n else ["cpu"] * n


def main(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.data_size < 1:
        raise SystemExit("fanfold demo: --batch-size and --data-size must be >= 1")
    torch.manual_seed(args.seed)
    device_ids = _device_ids(args.devices)
    device = normalize_device(device_ids[0])
    loader = DataLoader(torch.randn(args.data_size, 5), batch_size=args.batch_size, shuffle=True)  # RandomDataset(5, N)
    tqdm.write(f"Let's use {len(device_ids)} device(s): {', '.join(map(str, device_ids))}")
    model = DataParallel(Model(5, 2, write=tqdm.write).to(device), device_ids=device_ids)
    for data in tqdm(loader, desc="demo", unit="batch", disable=None):  # None: no bar unless stderr is a terminal
        input = data.to(device)
        output = model(input)
        tqdm.write(f"Outside: input size {input.size()} output_size {output.size()}")
    return 0
