"""A 2-process transformers Trainer run on the CPU under ``fanfold run -n 2``: ``_trainer_job.py MODE OUT``. MODE
``gloo``: ``TrainingArguments(use_cpu=True)``, Accelerate creates gloo's group; ``fanfold``:
``init_process_group("fanfold")`` first, the same arguments; ``ddp_backend``: ``ddp_backend="fanfold"`` without
``use_cpu`` (refused by the backend). Seeded; gradient_accumulation_steps=2; evaluation gathers predictions and
losses over the ranks (compute_metrics). Rank 0 saves the final parameters, the metrics and the log history."""
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

import fanfold  # noqa: F401 - registers the fanfold backend


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def metrics(p):
    return {"hits": float((p.predictions.argmax(-1) == p.label_ids).sum()), "seen": float(len(p.label_ids))}


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    if mode == "fanfold":
        dist.init_process_group("fanfold")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(len(y))]
    with tempfile.TemporaryDirectory() as tmp:
        cpu = {"ddp_backend": "fanfold"} if mode == "ddp_backend" else {"use_cpu": True}
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=4, per_device_eval_batch_size=5,
                                 gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=0.05, seed=0,
                                 eval_strategy="epoch", logging_steps=2, save_strategy="no", report_to=[],
                                 disable_tqdm=True, dataloader_num_workers=0, **cpu)
        torch.manual_seed(0)
        trainer = Trainer(model=Net(), args=args, train_dataset=data, eval_dataset=data[:23],
                          compute_metrics=metrics)
        trainer.train()
        final = trainer.evaluate()
        if trainer.is_world_process_zero():
            torch.save({"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                        "metrics": final, "log": trainer.state.log_history, "backend": dist.get_backend(),
                        "processes": args.world_size}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
