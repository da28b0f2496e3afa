"""`fanfold train` end to end: real launcher, real worker processes, a real SIGKILL.

Runs shared by all tests (module fixture): an uninterrupted 2-rank reference; a 2-rank run whose last rank is
SIGKILLed after step KILL (between checkpoints, so the steps since the last checkpoint are lost), then resumed by
running the advice it printed, exactly as printed, on 2 ranks and, from a copy, with --resume on 1; a 2-rank run
with --max-restarts 1 that the launcher restarts by itself after the same kill. The reference is the oracle: the
2-rank resumes must end with bitwise equal parameters and the same per-rank sample ledger; every ledger must show
each training sample once per epoch.

The kill and the per-rank sample ledger are no flags of fanfold's: tests/training/_faults/sitecustomize.py, put on
the runs' PYTHONPATH here, wraps the workers' data loader when FANFOLD_TEST_LEDGER / FANFOLD_TEST_KILL_AT_STEP are set.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fanfold
from fanfold import cli
from fanfold.cli import train as train_cli
from fanfold.training import job as train

# The shared runs are set up in the first test: on a busy machine that takes minutes, more than the default 300 s.
pytestmark = pytest.mark.timeout(900)
EPOCHS, EVERY, KILL = 2, 10, 33  # the kill is in the middle of epoch 2, 3 steps after the checkpoint of step 30
STEPS = 23  # an epoch: 1440 samples, global batch 64
TRAIN_SIZE = 1797 - train.TEST_SIZE
ARGS = ["--devices", "2", "--epochs", str(EPOCHS), "--checkpoint-every", str(EVERY), "--seed", "3"]
FAULTS = Path(__file__).parent / "_faults"


def _env(kill_at: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p)
    env["FANFOLD_TEST_LEDGER"] = "1"
    if kill_at is not None:
        env["FANFOLD_TEST_KILL_AT_STEP"] = str(kill_at)
    return env


def _fanfold(argv: list[str], kill_at: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fanfold", *argv], capture_output=True, text=True, timeout=240,
                          env=_env(kill_at))


def _train(*argv: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    return _fanfold(["train", *ARGS, *argv], kill_at)


def _advice(proc: subprocess.CompletedProcess) -> list[str]:
    """The command after "continue with: " on the last line of stderr, split as a shell would."""
    last = proc.stderr.strip().splitlines()[-1]
    assert "continue with: fanfold " in last, proc.stderr[-2000:]
    return shlex.split(last.split("continue with: ", 1)[1])


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    ref = _ok(_train("--out", str(root / "ref")))
    killed = _train("--out", str(root / "resume"), kill_at=KILL)
    saved_step = _load(root / "resume")[1]  # what the crash left behind, read before the resume overwrites it
    shutil.copytree(root / "resume", root / "one")
    one = _ok(_fanfold(["train", "--out", str(root / "one"), "--resume", "--devices", "1"]))
    advice = _advice(killed)
    resumed = _ok(_fanfold(advice[1:]))  # the advice as printed: no settings repeated, the checkpoint's are used
    restarted = _ok(_train("--out", str(root / "restart"), "--max-restarts", "1", kill_at=KILL))
    return {"root": root, "ref": ref, "killed": killed, "saved_step": saved_step, "resumed": resumed,
            "restarted": restarted, "one": one, "advice": advice}


def _load(out: Path) -> tuple[dict, int]:
    """The checkpoint's model parameters and step, read back outside any process group."""
    model = train.make_model()
    plain = fanfold.load(out / train.CHECKPOINT, {"model": model, "step": 0}, rng=False)
    return model.state_dict(), plain["step"]


def _ledger(out: Path) -> dict[int, list[tuple[int, int, list[int]]]]:
    """rank -> [(step, epoch, ids)] as the workers recorded them."""
    ledger = {}
    for path in sorted(out.glob("ledger-rank*.txt")):
        rows = [list(map(int, ln.split())) for ln in path.read_text().splitlines()]
        ledger[int(path.stem.removeprefix("ledger-rank"))] = [(r[0], r[1], r[2:]) for r in rows]
    return ledger


def _assert_exact_epochs(ledger) -> None:
    assert [r[0] for r in ledger[0]] == list(range(1, EPOCHS * STEPS + 1)), "rank 0: steps missing or repeated"
    for rank, rows in ledger.items():
        assert [r[0] for r in rows] == list(range(1, len(rows) + 1)), f"rank {rank}: steps missing or repeated"
    for epoch in range(EPOCHS):
        ids = sorted(i for rows in ledger.values() for _, e, batch in rows if e == epoch for i in batch)
        assert ids == list(range(TRAIN_SIZE)), f"epoch {epoch}: a sample was skipped or seen twice"


def test_short_run_learns_and_writes_its_files(runs):
    ref, out = runs["ref"], runs["root"] / "ref"
    accuracy = float(re.search(r"test accuracy: ([0-9.]+) \((\d+)/(\d+)", ref.stdout).group(1))
    assert accuracy >= 0.9, ref.stdout  # two epochs of one-cycle on 1440 digits (the default ten reach ~0.99)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test_samples"] == train.TEST_SIZE  # 357 over 2 ranks: no padded duplicate counted
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _load(out)[1] == EPOCHS * STEPS
    # Not a terminal: no progress bar, one plain line an epoch from rank 0
    assert re.findall(r"^epoch (\d)/2: step (\d+)/46, loss ", ref.stderr, re.M) == [("1", "23"), ("2", "46")]
    assert "0%|" not in ref.stderr and "\r" not in ref.stderr
    assert "Warning" not in ref.stderr, ref.stderr  # a new user's first run shows no library's warnings
    _assert_exact_epochs(_ledger(out))


def test_sigkill_then_resume_is_exact(runs):
    killed = runs["killed"]
    assert killed.returncode != 0, "the run with a SIGKILLed worker reported success"
    assert runs["advice"] == ["fanfold", "train", "--out", str(runs["root"] / "resume"), "--resume"]
    assert "killed by signal SIGKILL" in killed.stderr and killed.stderr.count("fanfold run: exit code") == 1
    assert runs["saved_step"] == KILL // EVERY * EVERY  # the kill lost the steps after the last checkpoint
    ref, _ = _load(runs["root"] / "ref")
    got, _ = _load(runs["root"] / "resume")
    for name in ref:
        assert torch.equal(ref[name], got[name]), f"{name} differs from the uninterrupted run"
    ledger = _ledger(runs["root"] / "resume")
    _assert_exact_epochs(ledger)
    assert ledger == _ledger(runs["root"] / "ref")


def test_max_restarts_recovers_from_sigkill_exactly(runs):
    out = runs["root"] / "restart"
    assert (out / f"killed-at-step-{KILL}").exists(), "the worker was never killed"
    ref, _ = _load(runs["root"] / "ref")
    got, _ = _load(out)
    for name in ref:
        assert torch.equal(ref[name], got[name]), f"{name} differs from the uninterrupted run"
    ledger = _ledger(out)
    _assert_exact_epochs(ledger)
    assert ledger == _ledger(runs["root"] / "ref")


def test_resume_on_another_world_size_trains_each_sample_once(runs):
    # 2 ranks until the kill, then 1: the sampler re-splits the rest of the epoch; parameters may differ in the
    # last bits (other sums), the data may not.
    ledger = _ledger(runs["root"] / "one")
    assert len(ledger[1]) == runs["saved_step"]  # rank 1's lost steps were rolled back with the checkpoint
    _assert_exact_epochs(ledger)
    assert "test accuracy" in runs["one"].stdout


def test_resume_with_changed_settings_is_refused_by_the_parent(runs, capsys):
    out = runs["root"] / "ref"
    before = (out / train.CHECKPOINT).stat().st_mtime_ns
    assert cli.main(["train", "--out", str(out), "--resume", "--epochs", "3", "--seed", "3", "--lr", "0.5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # One message, from the parent, before any worker (a worker would have printed a progress line or a warning).
    assert captured.err == (
        f"fanfold train: error: --resume: {out / train.CHECKPOINT} was trained with --epochs 2, --lr 0.01; "
        f"--epochs 3 --lr 0.5 would not continue that run. Continue it with its own settings: "
        f"fanfold train --out {out} --resume (or start a new run with another --out)\n")
    assert (out / train.CHECKPOINT).stat().st_mtime_ns == before
    assert train.saved_settings(out / train.CHECKPOINT) == {"epochs": 2, "batch_size": 64, "lr": 0.01, "seed": 3}


def test_bad_run_directory_is_refused(tmp_path, capsys):
    parser = cli.build_parser()
    assert cli.main(["train", "--out", str(tmp_path), "--resume"]) == 2
    assert f"no checkpoint at {tmp_path / train.CHECKPOINT}" in capsys.readouterr().err
    (tmp_path / train.CHECKPOINT).write_bytes(b"")
    assert cli.main(["train", "--out", str(tmp_path)]) == 2
    assert "already holds checkpoint.pt" in capsys.readouterr().err
    assert train_cli.main(parser.parse_args(["train", "--devices", "3", "--batch-size", "64"])) == 2
    assert "does not split evenly" in capsys.readouterr().err


def test_resume_and_restart_say_where_they_pick_up(runs):
    ckpt = runs["root"] / "resume" / train.CHECKPOINT
    assert f"fanfold train: resumed from {ckpt} at step {runs['saved_step']} of {EPOCHS * STEPS}\n" \
        in runs["resumed"].stderr
    restarted = runs["restarted"].stderr
    assert f"fanfold train: resumed from {runs['root'] / 'restart' / train.CHECKPOINT} at step 30 of 46" in restarted
    # the failed attempt is labelled, and the peer's "connection closed" noise is one line at most
    assert re.search(r"^fanfold run: local rank \d \(pid \d+\) .*; restarting \(attempt 1 of 1\)$", restarted, re.M), \
        restarted
    assert "Connection closed" not in restarted and "GLHF" not in restarted
    assert "resumed from" not in runs["ref"].stderr  # a fresh run resumes nothing
    # the start-up line comes first, before the workers' seconds of silence
    assert runs["ref"].stderr.startswith("fanfold train: starting 2 worker processes, writing to "), runs["ref"].stderr


def _interrupt(out: Path, *argv: str, when, pause_at: int | None = None) -> subprocess.CompletedProcess:
    """`fanfold train` in a session of its own (as a terminal's foreground job), Ctrl-C'd (SIGINT to the whole
    group, as a terminal sends it) once ``when(out, stderr so far)`` holds; ``pause_at``: rank 0 waits after that
    step (tests/training/_faults), so that the run is surely still going."""
    import select
    import signal
    import time

    env = _env()
    if pause_at is not None:
        env["FANFOLD_TEST_PAUSE_AT_STEP"] = str(pause_at)
    proc = subprocess.Popen([sys.executable, "-m", "fanfold", "train", *ARGS, "--out", str(out), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    err = ""
    try:
        deadline = time.monotonic() + 200
        while not when(out, err):
            assert proc.poll() is None and time.monotonic() < deadline, f"never reached the point\n{err}"
            if select.select([proc.stderr], [], [], 0.1)[0]:
                err += proc.stderr.readline()
        os.killpg(proc.pid, signal.SIGINT)
        rest_out, rest_err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, rest_out, err + rest_err)


def test_ctrl_c_before_the_first_checkpoint_leaves_no_run_folder(tmp_path):
    out = tmp_path / "runs" / "a"
    res = _interrupt(out, when=lambda out, err: "fanfold train: starting" in err)
    assert res.returncode == 130, res.stderr
    assert res.stderr.splitlines()[-1] == ("fanfold train: interrupted (Ctrl-C) before the first checkpoint: "
                                           f"nothing to resume; removed the empty {out}"), res.stderr
    assert "Traceback" not in res.stderr and "exit code 130" not in res.stderr
    assert not (tmp_path / "runs").exists()  # runs/ was created for this run too


def test_ctrl_c_after_a_checkpoint_says_how_to_resume(tmp_path):
    out = tmp_path / "a"
    res = _interrupt(out, "--checkpoint-every", "5", pause_at=5,
                     when=lambda out, err: (out / "paused-at-step-5").exists())
    assert res.returncode == 130, res.stderr
    assert res.stderr.splitlines()[-1] == f"fanfold train: interrupted (Ctrl-C); continue with: " \
                                          f"fanfold train --out {out} --resume", res.stderr
    assert "workers failed" not in res.stderr and "Traceback" not in res.stderr
    assert _load(out)[1] == 5


def _bad_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Run directories holding a checkpoint fanfold must refuse: random bytes, a truncated torch file, a pickle that
    would run code, and a real torch checkpoint of someone else's (no run settings)."""
    import pickle

    dirs = {name: tmp_path / name for name in ("random", "truncated", "malicious", "foreign")}
    for d in dirs.values():
        d.mkdir()
    (dirs["random"] / train.CHECKPOINT).write_bytes(bytes(range(256)) * 8)
    torch.save({"w": torch.randn(1000)}, dirs["truncated"] / train.CHECKPOINT)
    data = (dirs["truncated"] / train.CHECKPOINT).read_bytes()
    (dirs["truncated"] / train.CHECKPOINT).write_bytes(data[: len(data) // 2])

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    (dirs["malicious"] / train.CHECKPOINT).write_bytes(pickle.dumps({"run": Payload()}, protocol=2))
    torch.save({"model": torch.nn.Linear(2, 2).state_dict()}, dirs["foreign"] / train.CHECKPOINT)
    return dirs


def test_refused_checkpoints_are_one_error_line(tmp_path, capsys):
    dirs = _bad_checkpoints(tmp_path)
    for name, d in dirs.items():
        assert cli.main(["train", "--out", str(d), "--resume"]) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "", name
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"fanfold train: error: {d / train.CHECKPOINT}"), captured.err
    truncated = cli.main(["train", "--out", str(dirs["truncated"]), "--resume"])
    assert truncated == 2
    err = capsys.readouterr().err
    # torch's reason in full, not cut mid-sentence
    assert err.rstrip().endswith("or the file was modified after saving.)"), err
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    # the same from a shell: no traceback, exit 2
    res = _fanfold(["train", "--out", str(dirs["malicious"]), "--resume"])
    assert res.returncode == 2 and res.stderr.startswith("fanfold train: error: ") and "Traceback" not in res.stderr


def test_progress_bars_only_on_a_sized_terminal(tmp_path):
    """A pipe or file gets plain epoch lines; so does a pseudo-terminal of zero columns (tqdm drew empty lines
    there: `script -c "make run"` showed ten blank lines instead of the epochs); a sized terminal gets bars."""
    import fcntl
    import pty
    import struct
    import termios

    from fanfold.training.job import draws_bars

    with open(tmp_path / "log", "w") as f:
        assert not draws_bars(f)
    leader, follower = pty.openpty()
    try:
        with os.fdopen(os.dup(follower), "w") as tty:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 0, 0, 0))
            assert not draws_bars(tty)
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
            assert draws_bars(tty)
    finally:
        os.close(leader)
        os.close(follower)
