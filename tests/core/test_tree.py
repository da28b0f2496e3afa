"""_utils (device normalisation) and _tree (the nested-structure walk)."""
import collections
import dataclasses

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from fanfold._core.devices import default_device_ids, normalize_device, usable_devices
from fanfold._core.tree import first_difference, flatten, unflatten

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: object
    n: int = dataclasses.field(default=0, init=False)

    def __post_init__(self):
        object.__setattr__(self, "n", self.n + 1)  # counts how often __init__ ran


def test_normalize_device():
    assert normalize_device("cpu:0") == normalize_device(torch.device("cpu")) == torch.device("cpu")
    assert normalize_device(1).index == 1 and normalize_device(1).type in ("cuda", "xpu", "mps", "mtia", "hpu")
    assert usable_devices(["cpu", "cpu"]) == [torch.device("cpu")] * 2
    assert normalize_device(torch.device("cpu", 0)) == normalize_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="device_ids is empty"):
        usable_devices([])
    with pytest.raises(TypeError, match="device_ids must be a list of devices, got a single device 'cpu'"):
        usable_devices("cpu")
    with pytest.raises(TypeError, match=r"device_ids\[1\]: a device must be an int, a str or a torch.device"):
        usable_devices(["cpu", 1.0])
    with pytest.raises(ValueError, match=r"device_ids\[0\]: a device index must be >= 0, got -1"):
        usable_devices([-1])
    with pytest.raises(ValueError, match="not a device: 'gpu0'"):
        normalize_device("gpu0")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="CPU-only machine")
def test_default_device_ids_cpu_only():
    assert default_device_ids() == []


def test_flatten_paths_and_round_trip():
    t = torch.zeros(2)
    packed = pack_sequence([torch.zeros(2, 1)])
    obj = (t, {"mask": t, "p": Pair(1, [None, packed])}, Frozen(t), torch.zeros(3, 2).max(0))
    leaves, spec = flatten(obj, "inputs")
    paths = [str(p) for p, _ in leaves]
    assert paths == ["inputs[0]", "inputs[1]['mask']", "inputs[1]['p'].a", "inputs[1]['p'].b[0]",
                     "inputs[1]['p'].b[1]", "inputs[2].x", "inputs[2].n", "inputs[3][0]", "inputs[3][1]"]
    assert leaves[4][1] is packed  # a PackedSequence is one leaf
    rebuilt = unflatten(spec, [v for _, v in leaves])
    assert type(rebuilt[3]) is type(obj[3]) and type(rebuilt[1]["p"]) is Pair
    assert rebuilt[2].x is t and rebuilt[2].n == 1  # __post_init__ did not run again
    with pytest.raises(ValueError, match="fewer leaves"):
        unflatten(spec, [])
    with pytest.raises(ValueError, match="more leaves"):
        unflatten(spec, [None] * 10)


def test_dict_subclasses_keep_their_type_and_state():
    d = collections.defaultdict(list, {"a": 1})
    out = unflatten(flatten(d)[1], [2])
    assert type(out) is collections.defaultdict and out.default_factory is list and out == {"a": 2}
    assert d == {"a": 1}


def test_first_difference():
    spec = flatten({"a": (1, 2)})[1]
    assert first_difference(spec, flatten({"a": (1, 2)})[1]) is None
    assert first_difference(spec, flatten({"a": (1,)})[1], "out") == \
        "out['a']: a tuple with length 2 vs a tuple with length 1"
    assert first_difference(spec, flatten({"a": 1})[1], "out") == "out['a']: a tuple with length 2 vs a leaf"
    assert first_difference(flatten(Pair(1, 2))[1], flatten((1, 2))[1]) == \
        "<root>: a Pair with fields ['a', 'b'] vs a tuple with length 2"
