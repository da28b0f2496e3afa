"""Models with dropout for the pipeline's random-number tests, the oracle that replays their masks, and the function
the ranks run.

A helper module (``fanfold.launch`` imports the rank function by name). Each dropout layer records the mask of
every forward it runs, in order (a stage runs its micro-batches' forwards in order, so mask m is micro-batch m's),
and apart from those the masks its recomputations draw. The oracle is plain torch: the sequential model run on the
same micro-batches one after the other, each dropout applying the mask the pipeline's forward drew (``fixed``), the
micro-batch losses weighed by their rows. If a recomputation drew other masks, the pipeline's gradients differ from
it.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

import fanfold
import fanfold.distributed

ROWS = 10


def _in_backward() -> bool:
    # a checkpoint's recomputation runs inside a backward, the forward does not
    return torch._C._current_graph_task_id() != -1


class _Recording:
    """What both dropout layers share: the masks they drew, and a mask to apply instead (the oracle)."""

    p: float

    def _setup(self) -> None:
        self.masks: list[torch.Tensor] = []
        self.recomputed: list[torch.Tensor] = []
        self.fixed: torch.Tensor | None = None

    def _record(self, keep: torch.Tensor) -> None:
        (self.recomputed if _in_backward() else self.masks).append(keep.detach().clone())

    def _replay(self, x: torch.Tensor) -> torch.Tensor:
        # the same arithmetic as torch's CPU dropout: the input times (mask / (1 - p))
        return x * (self.fixed.to(x.dtype) / (1 - self.p))


class Dropout(_Recording, nn.Dropout):
    """An ``nn.Dropout``: a layer fanfold knows to draw random numbers."""

    def __init__(self, p: float):
        nn.Dropout.__init__(self, p)
        self._setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed is not None:
            return self._replay(x)
        out = super().forward(x)
        self._record(out != 0)  # the inputs are never exactly zero (float64, random weights)
        return out


class CustomDropout(_Recording, nn.Module):
    """Dropout by ``torch.rand``: a layer nothing can tell draws random numbers."""

    def __init__(self, p: float):
        nn.Module.__init__(self)
        self.p = p
        self._setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed is not None:
            return self._replay(x)
        keep = torch.rand(x.shape, dtype=x.dtype) >= self.p
        self._record(keep)
        return x * (keep.to(x.dtype) / (1 - self.p))


class RowParameter(nn.Module):
    """Row indices -> a parameter's rows: each output element has its own weight, so where its gradient is zero
    says exactly which elements the dropout stages dropped."""

    def __init__(self, rows: int = ROWS, features: int = 12):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, features, dtype=torch.float64))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.weight[index]


def mlp(kind: str, seed: int = 0) -> nn.Sequential:
    """Linear layers with dropout. ``"mixed"``: ``nn.Dropout`` layers and one custom one (the 3-stage cut [3, 3, 3]
    leaves stage 1 only the custom one); ``"custom"``: custom ones only, whose draws a checkpoint must replay
    without seeing them coming."""
    torch.manual_seed(seed)
    known = Dropout if kind == "mixed" else CustomDropout
    return nn.Sequential(
        nn.Linear(6, 16), known(0.5), nn.Tanh(), nn.Linear(16, 16), CustomDropout(0.3), nn.Tanh(),
        nn.Linear(16, 16), known(0.5), nn.Linear(16, 3),
    ).double()


def dropout_only(stages: int, kind: str = "mixed", seed: int = 0) -> nn.Sequential:
    """``RowParameter`` then one dropout per stage (stage 0 holds both): stages that only drop."""
    torch.manual_seed(seed)
    layers = [Dropout(0.5) if kind == "mixed" and s != 1 else CustomDropout(0.5) for s in range(stages)]
    return nn.Sequential(RowParameter(), *layers)


MODELS = {kind: functools.partial(mlp, kind) for kind in ("mixed", "custom")}
BALANCE = {2: [4, 5], 3: [3, 3, 3]}


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, 6, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 3, generator=g, dtype=torch.float64))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


class RecordingDot:
    """The loss ``(out * target).sum()``, keeping each micro-batch's output (the last stage computes the losses in
    micro-batch order)."""

    def __init__(self):
        self.outputs: list[torch.Tensor] = []

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.outputs.append(out.detach().clone())
        return (out * target).sum()


def row_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout-only model's input (row indices) and a target without zeros."""
    g = torch.Generator().manual_seed(3)
    return torch.arange(ROWS), torch.rand(ROWS, 12, generator=g, dtype=torch.float64) + 0.5


def drops(model: nn.Module) -> dict[str, _Recording]:
    return {n: m for n, m in model.named_modules() if isinstance(m, _Recording)}


def masks(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each dropout's forward masks, micro-batch by micro-batch."""
    return {n: list(d.masks) for n, d in drops(model).items()}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def oracle_grads(build, x: torch.Tensor, y: torch.Tensor, chunks: int, forward_masks: dict) -> dict:
    """Plain torch: the sequential model on ``x.chunk(chunks)`` in turn, each dropout applying the pipeline's forward
    mask of that micro-batch, ``mse`` weighed by rows / batch (``train_step``'s ``reduction="mean"``)."""
    model = build()
    layers = drops(model)
    for m, (xm, ym) in enumerate(zip(x.chunk(chunks), y.chunk(chunks))):
        for name, layer in layers.items():
            layer.fixed = forward_masks[name][m]
        (mse(model(xm), ym) * (len(xm) / len(x))).backward()
    return grads(model)


# ---- the function the ranks run (fanfold.launch) ----------------------------------------------------------------
def stage_per_process(configs: list[tuple[str, int, str, str]], seed: int) -> dict:
    """Rank r is stage r of 2. For each (kind, chunks, schedule, checkpoint), twice: one ``train_step`` from
    ``torch.manual_seed(seed)``; this stage's gradients and forward masks. Then the dropout-only model (kind
    "rows:<kind>"): the parameter's gradient (stage 0) and the outputs (stage 1)."""
    fanfold.distributed.init_process_group(timeout=120)
    out = {}
    for kind, chunks, schedule, checkpoint in configs:
        for repeat in range(2):
            if kind.startswith("rows:"):
                model = dropout_only(2, kind.split(":")[1])
                x, y = row_batch()
                loss_fn = RecordingDot()
            else:
                model = MODELS[kind]()
                x, y = batch()
                loss_fn = mse
            pipe = fanfold.DistributedPipeline(model, [2, 1] if kind.startswith("rows:") else BALANCE[2], chunks,
                                               checkpoint)
            torch.manual_seed(seed)
            pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, loss_fn, schedule=schedule)
            result = {"grads": grads(pipe), "masks": masks(pipe)}
            if kind.startswith("rows:") and pipe.is_last:
                result["output"] = torch.cat(loss_fn.outputs)
            out[kind, chunks, schedule, checkpoint, repeat] = result
    dist.barrier()
    return out
