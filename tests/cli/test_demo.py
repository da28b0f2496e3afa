"""`fanfold demo`: the tutorial's per-replica and per-step sizes for 1, 2, 3 and 8 CPU replicas, whole lines only."""
import re

import pytest

from fanfold import cli
from fanfold._core.devices import default_device_ids

IN_MODEL = re.compile(r"  In Model: input size torch\.Size\(\[(\d+), 5\]\) output size torch\.Size\(\[(\d+), 2\]\)")
OUTSIDE = re.compile(r"Outside: input size torch\.Size\(\[(\d+), 5\]\) output_size torch\.Size\(\[(\d+), 2\]\)")

# the tutorial's sizes: 100 rows in batches of 30 (three full batches, then 10 rows), split with torch.chunk
EXPECTED = {
    1: [[30], [30], [30], [10]],
    2: [[15, 15]] * 3 + [[5, 5]],
    3: [[10, 10, 10]] * 3 + [[4, 4, 2]],
    8: [[4] * 7 + [2]] * 3 + [[2] * 5],
}


@pytest.mark.skipif(bool(default_device_ids()), reason="on an accelerator machine --devices picks GPUs")
@pytest.mark.parametrize("devices", sorted(EXPECTED))
def test_demo_prints_the_tutorial_sizes(devices, capsys):
    assert cli.main(["demo", "--devices", str(devices)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Let's use {devices} device(s): {', '.join(['cpu'] * devices)}"
    steps, chunks = [], []
    for line in lines[1:]:
        inside, outside = IN_MODEL.fullmatch(line), OUTSIDE.fullmatch(line)
        assert inside or outside, f"not a whole demo line (interleaved output?): {line!r}"
        if inside:
            assert inside[1] == inside[2]
            chunks.append(int(inside[1]))
        else:
            assert outside[1] == outside[2] and int(outside[1]) == sum(chunks)
            steps.append(sorted(chunks, reverse=True))  # replicas run concurrently: their lines come in any order
            chunks = []
    assert chunks == []
    assert steps == EXPECTED[devices]


def test_demo_other_sizes_and_bad_arguments(capsys):
    assert cli.main(["demo", "--devices", "2", "--batch-size", "8", "--data-size", "20", "--seed", "3"]) == 0
    outside = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Outside")]
    assert len(outside) == 3 and "torch.Size([4, 5])" in outside[-1]
    with pytest.raises(SystemExit, match="--devices must be >= 1"):
        cli.main(["demo", "--devices", "0"])
