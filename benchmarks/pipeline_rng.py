"""Cost of the pipeline's random-number control (docs/pipeline.md, *Cost of the random-number control*).

One ``Pipeline.train_step``, 2 CPU stages on threads (1 intra-op thread each), an MLP of 4 x (Linear(1024, 1024),
ReLU[, Dropout(0.1)]), batch 256, 8 micro-batches; for dropout on/off x checkpoint never/always x 1F1B/GPipe, the
median of 6 steps after 2 warm-up steps; prints one JSON line of seconds per row. For a before/after A/B, run it
alternately on two trees in fresh processes and take the medians over the rounds:

    git archive 59fc50c src | tar -x -C /tmp/before
    for r in 1 2 3 4; do
      PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/pipeline_rng.py > before.$r.json
      PYTHONPATH=$PWD/src .venv/bin/python benchmarks/pipeline_rng.py > after.$r.json
    done
"""
from __future__ import annotations

import json
import statistics
import time
import warnings

import torch
from torch import nn

import fanfold

WIDTH, PAIRS, BATCH, CHUNKS = 1024, 4, 256, 8


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def step_time(dropout: bool, checkpoint: str, schedule: str, steps: int = 6) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(PAIRS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()] + ([nn.Dropout(0.1)] if dropout else [])
    half = len(layers) // 2
    pipe = fanfold.Pipeline(layers, [half, len(layers) - half], ["cpu", "cpu"], chunks=CHUNKS, checkpoint=checkpoint)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    for _ in range(2):
        pipe.train_step(x, y, mse, schedule=schedule)
    times = []
    for _ in range(steps):
        pipe.zero_grad(set_to_none=True)
        start = time.perf_counter()
        pipe.train_step(x, y, mse, schedule=schedule)
        times.append(time.perf_counter() - start)
    pipe.close()
    return statistics.median(times)


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # the code before the control warned when it fell back to one thread
    print(json.dumps({f"{'dropout' if d else 'plain'}/{c}/{s}": step_time(d, c, s)
                      for d in (True, False) for c in ("never", "always") for s in ("1f1b", "gpipe")}))
