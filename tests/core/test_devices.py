"""The device check every primitive shares (``fanfold._core.devices.usable_device(s)``): on a machine without CUDA,
naming a CUDA device is a ValueError naming the argument and the CPU spelling, from every entry point, where torch's
own code fails deep inside with "Torch not compiled with CUDA enabled"."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fanfold
from fanfold._core.devices import accelerator_type, usable_device, usable_devices
from fanfold.parallel.functions import Broadcast, Gather, ReduceAdd, Scatter

pytestmark = pytest.mark.skipif(accelerator_type() is not None, reason="needs a machine without an accelerator")

LIST = r"{name}\[{i}\] is cuda:{i}, but this machine has no cuda device; for CPU replicas give {name}=\['cpu'\] \* {n}$"
ONE = r"^{name} is cuda:0, but this machine has no cuda device; for the CPU give {name}='cpu'$"


def _entry_points():
    x, model = torch.randn(4, 3), nn.Linear(3, 2)
    cpu2 = ["cpu", "cpu"]
    return {
        "scatter": (lambda: fanfold.scatter(x, ["cuda:0", "cuda:1"]), LIST.format(name="target_gpus", i=0, n=2)),
        "scatter_kwargs": (lambda: fanfold.scatter_kwargs((x,), {}, ["cpu", "cuda:1"]),
                           LIST.format(name="target_gpus", i=1, n=2)),
        "gather": (lambda: fanfold.gather([x, x], "cuda:0"), ONE.format(name="target_device")),
        "replicate": (lambda: fanfold.replicate(model, ["cuda:0"]), LIST.format(name="devices", i=0, n=1)),
        "parallel_apply": (lambda: fanfold.parallel_apply([model], [x], devices=["cuda:0"]),
                           LIST.format(name="devices", i=0, n=1)),
        "DataParallel device_ids": (lambda: fanfold.DataParallel(model, [0, 1]),
                                    LIST.format(name="device_ids", i=0, n=2)),
        "DataParallel output_device": (lambda: fanfold.DataParallel(model, cpu2, output_device="cuda:0"),
                                       ONE.format(name="output_device")),
        "data_parallel": (lambda: fanfold.data_parallel(model, x, cpu2, output_device=0),
                          ONE.format(name="output_device")),
        "Broadcast": (lambda: Broadcast.apply(["cpu", "cuda:1"], x), LIST.format(name="devices", i=1, n=2)),
        "Scatter": (lambda: Scatter.apply(["cuda:0", "cpu"], [2, 2], 0, x), LIST.format(name="devices", i=0, n=2)),
        "Gather": (lambda: Gather.apply("cuda:0", 0, x), ONE.format(name="destination")),
        "ReduceAdd": (lambda: ReduceAdd.apply("cuda:0", x), ONE.format(name="destination")),
    }


@pytest.mark.parametrize("entry", list(_entry_points()))
def test_every_primitive_names_the_missing_device(entry):
    call, message = _entry_points()[entry]
    with pytest.raises(ValueError, match=message):
        call()


def test_the_check_itself():
    assert usable_devices(["cpu", "cpu:0", "meta"], "d") == [torch.device("cpu")] * 2 + [torch.device("meta")]
    assert usable_device("cpu:0", "x") == torch.device("cpu")
    with pytest.raises(ValueError, match=re.escape("d[1] is xpu:0, but this machine has no xpu device")):
        usable_devices(["cpu", "xpu:0"], "d")
    with pytest.raises(TypeError, match=r"^out: a device must be an int, a str or a torch\.device"):
        usable_device(1.5, "out")
