"""A 2-process Lightning run on the CPU, launched by Lightning itself (``devices=2``: its popen launcher runs this
script again per rank): ``python _lightning_job.py STRATEGY OUT``, STRATEGY one of ``gloo`` (DDPStrategy),
``fanfold`` (DDPStrategy(process_group_backend="fanfold")) or ``fanfold_ddp`` (fanfold's FanfoldDDPStrategy).
Seeded; accumulate_grad_batches=2; logs with sync_dist=True in training and validation, and calls the strategy's
all_gather, reduce, reduce_boolean_decision, barrier and broadcast. Rank 0 saves the final parameters and what every
call returned to OUT."""
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fanfold  # noqa: F401 - registers the fanfold backend


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.calls = {}

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)
        self.log("val_hits", (self.net(x).argmax(1) == y).sum(), sync_dist=True, reduce_fx="sum")

    def on_train_epoch_end(self):
        s, r = self.trainer.strategy, self.global_rank
        self.wrapper = f"{type(s.model).__module__}.{type(s.model).__name__}"
        epoch = self.current_epoch
        self.calls[f"all_gather {epoch}"] = self.all_gather(torch.arange(3) + 10 * r)
        self.calls[f"reduce mean float {epoch}"] = s.reduce(torch.tensor([1.5, -2.25]) * (r + 1), reduce_op="mean")
        self.calls[f"reduce mean int {epoch}"] = s.reduce(torch.tensor([7, -7, 2]) * (r + 2), reduce_op="mean")
        self.calls[f"reduce sum {epoch}"] = s.reduce(torch.tensor([r + 1]), reduce_op="sum")
        self.calls[f"decision {epoch}"] = s.reduce_boolean_decision(r == 0, all=False)
        s.barrier("epoch end")
        self.calls[f"broadcast {epoch}"] = s.broadcast({"epoch": epoch, "rank": r}, src=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(kind: str, out: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    data = TensorDataset(x, y)
    if kind == "fanfold_ddp":
        from fanfold.integrations.lightning import FanfoldDDPStrategy
        strategy = FanfoldDDPStrategy()
    else:
        strategy = DDPStrategy(process_group_backend=None if kind == "gloo" else kind)
    model = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, accumulate_grad_batches=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=12))
    if trainer.global_rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
                    "calls": model.calls, "backend": torch.distributed.get_backend() if
                    torch.distributed.is_initialized() else trainer.strategy.process_group_backend,
                    "strategy": type(trainer.strategy).__name__, "wrapper": model.wrapper}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
