"""A 2-process Accelerate run on the CPU under ``fanfold run -n 2`` (torchrun's environment):
``_accelerate_job.py MODE OUT``. MODE ``gloo``: ``Accelerator(cpu=True)``, which creates gloo's group; ``fanfold``:
``init_process_group("fanfold")`` first, then ``Accelerator(cpu=True)``; ``kwargs``: Accelerate's documented
``InitProcessGroupKwargs(backend="fanfold")`` without ``cpu=True`` (refused by the backend). Seeded; gradient
accumulation over 2 steps (``accelerator.accumulate``); calls gather, gather_for_metrics, reduce,
pad_across_processes, broadcast and wait_for_everyone. Rank 0 saves the final parameters and every call's result."""
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import broadcast, broadcast_object_list, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fanfold  # noqa: F401 - registers the fanfold backend


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    if mode == "kwargs":
        Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="fanfold")])
        return
    if mode == "fanfold":
        dist.init_process_group("fanfold")
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    r, calls = acc.process_index, {}
    for epoch in range(2):
        for xb, yb in loader:
            with acc.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
        calls[f"gather {epoch}"] = acc.gather(loss.detach().reshape(1))
        calls[f"gather_for_metrics {epoch}"] = acc.gather_for_metrics(model(x[:5]).argmax(1))
        calls[f"reduce sum {epoch}"] = acc.reduce(torch.tensor([1.5, r + 1.0]), reduction="sum")
        calls[f"reduce mean {epoch}"] = acc.reduce(torch.tensor([1.5, r + 1.0]), reduction="mean")
        calls[f"reduce int {epoch}"] = acc.reduce(torch.tensor([7 * (r + 2)]), reduction="sum")
        padded = acc.pad_across_processes(torch.arange(2 + r, dtype=torch.int64), dim=0, pad_index=-1)
        calls[f"pad {epoch}"] = acc.gather(padded)
        calls[f"broadcast {epoch}"] = broadcast(torch.tensor([10.0 + r]), from_process=1)
        calls[f"objects {epoch}"] = broadcast_object_list([{"rank": r}], from_process=1)
        acc.wait_for_everyone()
    wrapped = type(model).__module__
    if acc.is_main_process:
        torch.save({"params": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
                    "calls": calls, "backend": dist.get_backend(), "state_backend": acc.state.backend,
                    "wrapped": wrapped, "processes": acc.num_processes}, out)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
