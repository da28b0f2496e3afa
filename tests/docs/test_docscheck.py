"""The docs check itself, on a small tree of its own: each kind of break is found, and named by page and line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from docscheck import check, generated  # noqa: E402  (tools/ on the path first)

GOOD = """\
# Title

## Usage

See [usage](#usage) and [the other page](docs/other.md#details); the test `tests/test_x.py::test_one` and
`examples/run.py`; `make test`; `FANFOLD_STALL_TIMEOUT`; `fanfold.DataParallel`;
`fanfold run -n 2 --max-restarts 1 x.py --lr 3`.

```python
print("hello")
```

```python
# not run: needs a GPU
import torch; torch.zeros(1).cuda()
```

<!-- generated speed: python benchmarks/speed.py | sha256:HASH -->
Run of 2026-12-07 on commit abc1234, 2 CPUs: 12.5 ms
<!-- /generated speed -->
"""


def tree(tmp_path: Path, page: str) -> Path:
    (tmp_path / "docs").mkdir()
    for rel in ("tests/test_x.py", "examples/run.py", "benchmarks/speed.py"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("def test_one():\n    pass\n")
    (tmp_path / "Makefile").write_text("test:\n\ttrue\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "env.py").write_text("import os\nos.environ.get('FANFOLD_STALL_TIMEOUT')\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Details\n")
    body = "Run of 2026-12-07 on commit abc1234, 2 CPUs: 12.5 ms"
    (tmp_path / "README.md").write_text(page.replace("HASH", generated.digest(body)))
    return tmp_path


def findings(root: Path, snippets: bool = False) -> list[str]:
    found = check.static(root) + (check.run_snippets(root, timeout=120) if snippets else [])
    return [str(f) for f in found]


def test_a_good_page_passes(tmp_path):
    assert findings(tree(tmp_path, GOOD)) == []


@pytest.mark.parametrize("old, new, line, words", [
    ("[usage](#usage)", "[usage](#nowhere)", 5, "#nowhere"),
    ("(docs/other.md#details)", "(docs/missing.md)", 5, "docs/missing.md does not exist"),
    ("(docs/other.md#details)", "(docs/other.md#nope)", 5, "no heading of other.md has the anchor #nope"),
    ("`tests/test_x.py::test_one`", "`tests/test_y.py`", 5, "path tests/test_y.py does not exist"),
    ("tests/test_x.py::test_one", "tests/test_x.py::test_two", 5, "has no test or class test_two"),
    ("`make test`", "`make tests`", 6, "no target 'tests'"),
    ("`FANFOLD_STALL_TIMEOUT`", "`FANFOLD_NOPE`", 6, "FANFOLD_NOPE: no code reads it"),
    ("`fanfold.DataParallel`", "`fanfold.DataParalel`", 6, "fanfold.DataParalel: fanfold has no such name"),
    ("--max-restarts 1", "--max-restart 1", 7, "fanfold run --max-restart: no such option"),
    ("`fanfold run -n 2", "`fanfold walk -n 2", 7, "fanfold walk: no such subcommand"),
    ("# not run: needs a GPU", "# not run", 13, "without a reason"),
    ("12.5 ms\n<!--", "12.6 ms\n<!--", 18, "'speed' was edited by hand"),
    ("on commit abc1234, ", "", 18, "does not say the commit"),
    ("## Usage", "## Usage\n\nA step takes 12.5 ms here.", 5, "measured figure '12.5 ms' outside a generated block"),
    ("## Usage", "## Usage\n\nThat was round 3 of issue 12.", 5, "history on a page: 'round 3'"),
])
def test_each_break_is_named_by_page_and_line(tmp_path, old, new, line, words):
    assert old in GOOD
    root = tree(tmp_path, GOOD.replace(old, new, 1))
    found = findings(root)
    assert any(f.startswith(f"README.md:{line}: ") and words in f for f in found), found


def test_settings_and_code_are_not_figures(tmp_path):
    page = GOOD.replace("## Usage", "## Usage\n\nThe timeout is 300 s by default; the default is 25 MiB; "
                                    "`timeout=120 s`; sizes `1 << 20`.\n\n```python\nx = 1  # 30 ms\n```\n")
    assert [f for f in findings(tree(tmp_path, page)) if "figure" in f] == []


def test_debt_lets_listed_figures_through_and_reports_stale_entries(tmp_path):
    root = tree(tmp_path, GOOD.replace("## Usage", "## Usage\n\nA step takes 12.5 ms here."))
    found = check.static(root)
    debt = [("figure", "README.md", 5, "12.5 ms"), ("figure", "README.md", 9, "3 s")]
    left = [str(f) for f in check.apply_debt(found, debt, "debt.txt")]
    assert left == ["debt.txt:1: debt entry 'figure README.md:9: 3 s' no longer occurs: remove it"]


def test_write_block_seals_what_the_check_accepts(tmp_path):
    root = tree(tmp_path, GOOD)
    generated.write_block(root / "README.md", "speed", "python benchmarks/speed.py",
                          "Run of 2027-01-02 on commit def5678, 2 CPUs: 11.0 ms")
    generated.write_block(root / "README.md", "new", "python benchmarks/speed.py",
                          "Run of 2027-01-02 on commit def5678, 2 CPUs: 3.0 ms")
    text = (root / "README.md").read_text()
    assert "11.0 ms" in text and "12.5 ms" not in text and text.count("<!-- /generated new -->") == 1
    assert findings(root) == []


@pytest.mark.timeout(400)
def test_snippets_that_fail_are_named_and_launched_ones_run(tmp_path):
    page = GOOD.replace('print("hello")', 'raise SystemExit("boom")') + """
```python
# run: fanfold run -n 2 block.py
from fanfold import distributed as fd
import torch
fd.init_process_group()
t = torch.ones(1)
torch.distributed.all_reduce(t)
assert t.item() == 2 and fd.world_size() == 2
fd.destroy_process_group()
```
"""
    found = [str(f) for f in check.run_snippets(tree(tmp_path, page), timeout=150)]
    assert len(found) == 1 and found[0].startswith("README.md:9: python block fails") and "boom" in found[0], found
