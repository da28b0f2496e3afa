"""The long differential run (`make fuzz`): the strategies of ``test_ddp.py`` on named seeds, every outcome counted,
nothing stopping at the first difference; the report goes into docs/differential.md between its markers.

    python tests/differential/fuzz.py                       # the named seeds: 1,000 DDP + 120 ZeRO configurations
    python tests/differential/fuzz.py --seeds a --ddp 100   # a shorter run
    python tests/differential/fuzz.py --minutes 20          # stop after 20 minutes, report what ran
    python tests/differential/fuzz.py --no-report           # print only
    python tests/differential/fuzz.py --seeds elm fir --hogs 4   # new seeds, 4 CPU-bound processes beside the run

The configurations are drawn first, then run: rounds over the named seeds, ``CHUNK`` draws from each seed per round
(hypothesis seeds "alder/0", "birch/0", ..., "alder/1", ...: one seed's draws stay close to its first ones, fresh
sub-seeds spread them), duplicates dropped, until ``--ddp`` DDP configurations that are not known defects. The
ZeRO configurations are spread evenly among the DDP ones, so that a time budget reaches both. The same command draws
the same configurations.

Rank processes are started once per world size and reused (``pool.py``); a configuration that crashes or hangs
restarts its pool and is counted as such. Every configuration that does not pass is printed with its detail, ready
to paste as an ``@example`` into ``test_ddp.py``. An interrupted run (Ctrl-C, SIGTERM, ``--minutes``) still reports
what it ran, marked partial.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import pathlib
import signal
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: import the package from tests/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    __package__ = "differential"

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from differential.config import TORCH_KEYWORDS, DDPConfig, ddp_configs, known_defect, zero_configs  # noqa: E402
from differential.runner import Runner, Tally  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
from docscheck.generated import write_block  # noqa: E402  (tools/docscheck/generated.py: the sealed block)

SEEDS = ("alder", "birch", "cedar", "damson")
DDP_DEFAULT, ZERO_DEFAULT = 1000, 120  # issue 24: at least 1,000 DDP configurations
CHUNK = 25  # draws per seed and round
REPORT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "differential.md"
SLOW = 20.0  # seconds: a configuration this slow is printed whatever its outcome (a wait that ran into a timeout)
OUTCOME_ORDER = ("match", "match-oracle", "both-raise", "DIFFER", "crash", "hang", "known-defect")
PASSING = ("match", "match-oracle", "both-raise", "known-defect")
PROGRESS = 50  # configurations between progress lines


def _seed_number(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def draw(strategy, name: str, count: int) -> list:
    """``count`` configurations drawn by ``strategy`` from the named seed ``name``: hypothesis's generation only, no
    test runs while drawing (nothing the ranks do steers what is drawn), so a list is what a test would see."""
    out: list = []

    @seed(_seed_number(name))
    @settings(max_examples=count, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(config=strategy)
    def collect(config):
        out.append(config)

    collect()
    return out


def draw_until(strategy, seeds, target: int, runnable=lambda c: True) -> tuple[list, int]:
    """Rounds over ``seeds`` (``CHUNK`` draws of "<seed>/<round>" each) until ``target`` distinct configurations
    for which ``runnable`` holds; the distinct configurations in order (the others too, in their place) and the
    number of duplicates dropped."""
    seen: dict = {}  # repr -> configuration (a keyword's value may be a list: not hashable)
    dropped = counted = rounds = 0
    while counted < target:
        for name in seeds:
            for config in draw(strategy, f"{name}/{rounds}", CHUNK):
                if repr(config) in seen:
                    dropped += 1
                    continue
                seen[repr(config)] = config
                counted += runnable(config)
                if counted >= target:
                    return list(seen.values()), dropped
        rounds += 1
    return list(seen.values()), dropped


def interleave(ddp: list, zero: list) -> list:
    """The ZeRO configurations spread evenly among the DDP ones."""
    out, j = [], 0
    for i, config in enumerate(ddp):
        while j < len(zero) and j * len(ddp) <= i * len(zero):
            out.append(zero[j])
            j += 1
        out.append(config)
    return out + zero[j:]


def _row(label: str, counts) -> str:
    return f"| {label} | " + " | ".join(str(counts.get(k, 0)) for k in OUTCOME_ORDER) + " |"


def _table(tally: Tally, what: str, prefixes=None) -> list[str]:
    out = [f"| {what} | " + " | ".join(OUTCOME_ORDER) + " |", "|---" * (len(OUTCOME_ORDER) + 1) + "|"]
    for label in sorted(tally.by_label):
        if prefixes is None or label.startswith(prefixes):
            out.append(_row(f"`{label}`", tally.by_label[label]))
    return out


def _commit() -> str:
    """", on commit <short hash>" of the tree under test ("+ changes" where src/ differs from it); "" where git
    cannot say (an archive, no git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPORT.parents[1], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f", on commit {head}{' + changes' if dirty else ''}"


def start_hogs(count: int) -> list[subprocess.Popen]:
    """``count`` CPU-bound Python processes, a busy machine's other jobs; the run kills them (by their own ids)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait(timeout=30)


def report(runner: Runner, command: str, wall: float, drawn: dict, partial: str | None, hogs: int = 0) -> str:
    ddp, zero = runner.tallies["DDP"], runner.tallies["ZeRO"]
    n_ddp, n_zero = sum(ddp.outcomes.values()), sum(zero.outcomes.values())
    skipped = ddp.outcomes.get("known-defect", 0)
    failed = sum(t.outcomes.get(k, 0) for t in (ddp, zero) for k in ("DIFFER", "crash", "hang"))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = []
    if partial:
        out += [f"**PARTIAL: {partial}; the counts below are what ran before it stopped.**", ""]
    made = " (what `make fuzz` runs)" if command.endswith(".py") else ""
    beside = f", with {hogs} CPU-bound processes running beside it" if hogs else ""
    out += [f"Run of {when}{_commit()}: `{command}`{made}, {wall / 60:.1f} minutes on this machine's two "
            f"cores{beside}. "
            f"Drawn: {drawn['ddp']} distinct DDP configurations ({drawn['ddp_dup']} duplicate draws dropped) "
            f"and {drawn['zero']} ZeRO ones ({drawn['zero_dup']} dropped). Run: **{n_ddp - skipped} DDP "
            f"configurations** ({skipped} more skipped as known defects) and **{n_zero} ZeRO configurations**; "
            f"**{failed} differences, crashes or hangs**.", "",
            "| outcome | " + " | ".join(OUTCOME_ORDER) + " |", "|---" * (len(OUTCOME_ORDER) + 1) + "|",
            _row("DDP configurations", ddp.outcomes), _row("ZeRO configurations", zero.outcomes), "",
            "Time per configuration, by outcome (seconds, from sending it to the ranks to the verdict; a pool "
            "restarted after a crash starts within the next one's time):", "",
            "| outcome | configurations | total s | mean s | max s |", "|---|---|---|---|---|"]
    for kind in OUTCOME_ORDER:
        secs = ddp.seconds.get(kind, []) + zero.seconds.get(kind, [])
        if secs:
            out.append(f"| {kind} | {len(secs)} | {sum(secs):.0f} | {sum(secs) / len(secs):.2f} | {max(secs):.1f} |")
    slow = sorted(ddp.slowest + zero.slowest, key=lambda t: -t[0])[:5]
    out += ["", "The slowest: " + "; ".join(f"{s:.1f} s ({kind}, world {c.world}, {c.backend}"
                                             + (f", {c.family}" if isinstance(c, DDPConfig) else "") + ")"
                                             for s, kind, c in slow) + ".", ""]
    out += ["DDP, by world size, process group and fanfold's transport:", ""]
    out += _table(ddp, "label", ("world=", "backend=", "transport="))
    keywords = collections.Counter()
    for label, counts in ddp.by_label.items():
        name = label.partition("=")[0]
        if name in TORCH_KEYWORDS:
            keywords[name] += sum(counts.values())
        if name == "delay_all_reduce_named_params":  # drawn together (the first layer's weight)
            keywords["param_to_hook_all_reduce"] += sum(counts.values())
    missing = [k for k in TORCH_KEYWORDS if k not in keywords]
    out += ["", f"Keyword coverage: {len(keywords)} of the {len(TORCH_KEYWORDS)} keywords of torch's "
            "`DistributedDataParallel` (after `module`) drawn away from their defaults"
            + (f" (not drawn: {', '.join(f'`{k}`' for k in missing)})" if missing else "") + "; by keyword and "
            "everything else drawn (a configuration counts under each of its labels):", ""]
    out += _table(ddp, "label", None)
    out += ["", "ZeRO (`fanfold.ZeroRedundancyOptimizer`, stage 2 via `shard_gradients`) against torch's optimizer "
            "on the whole batch:", ""]
    out += _table(zero, "label", None)
    out += ["", "Why DDP configurations were not a plain match (the deviation and its oracle, or the two errors):", ""]
    out += [f"- {count} x {reason}" for reason, count in ddp.reasons.most_common(40)]
    out += ["", "Configurations that did not pass (known defects: the name of the entry in `KNOWN_DEFECTS`):", ""]
    known: collections.Counter = collections.Counter()
    for tally in (ddp, zero):
        for config, outcome in tally.noteworthy:
            if outcome.kind == "known-defect":
                known[outcome.detail] += 1
            else:
                out.append(f"- **{outcome.kind}** {outcome.detail[:400]}  \n  `{config!r}`")
    out += [f"- known defect `{name}`: {count} draws skipped" for name, count in sorted(known.items())]
    if not known and not failed:
        out.append("- none")
    return "\n".join(out)


def _stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", default=list(SEEDS))
    parser.add_argument("--ddp", type=int, default=DDP_DEFAULT,
                        help="DDP configurations to run (distinct, known defects not counted)")
    parser.add_argument("--zero", type=int, default=ZERO_DEFAULT, help="ZeRO configurations to run")
    parser.add_argument("--compile", type=float, default=0.02, help="share of DDP draws under torch.compile")
    parser.add_argument("--minutes", type=float, default=float("inf"), help="stop after this long")
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every configuration with its time")
    parser.add_argument("--hogs", type=int, default=0, metavar="N",
                        help="run N CPU-bound processes beside the run (a busy machine)")
    args = parser.parse_args()
    command = " ".join(["python tests/differential/fuzz.py", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, _stop)
    start = time.monotonic()
    ddp, ddp_dup = draw_until(ddp_configs(compile_p=args.compile), args.seeds, args.ddp,
                              lambda c: known_defect(c) is None)
    zero, zero_dup = draw_until(zero_configs(), args.seeds, args.zero) if args.zero > 0 else ([], 0)
    drawn = {"ddp": len(ddp), "ddp_dup": ddp_dup, "zero": len(zero), "zero_dup": zero_dup}
    print(f"drawn in {time.monotonic() - start:.0f} s: {drawn}", flush=True)
    runner = Runner()
    partial = None
    hogs = start_hogs(args.hogs)
    try:
        for i, config in enumerate(interleave(ddp, zero), 1):
            if time.monotonic() - start > args.minutes * 60:
                partial = f"stopped by --minutes {args.minutes:g} after {i - 1} configurations"
                break
            begin = time.monotonic()
            outcome = runner.run(config)
            seconds = time.monotonic() - begin
            if args.verbose:
                print(f"{seconds:6.2f} s {outcome.kind}: {outcome.detail[:120]} || {config!r}", flush=True)
            elif outcome.kind not in PASSING or seconds > SLOW:
                print(f"{outcome.kind} ({seconds:.0f} s): {outcome.detail}\n    {config!r}", flush=True)
            if i % PROGRESS == 0:
                print(f"{i} run, {(time.monotonic() - start) / 60:.1f} min: DDP "
                      f"{dict(runner.tallies['DDP'].outcomes)}, ZeRO {dict(runner.tallies['ZeRO'].outcomes)}",
                      flush=True)
    except KeyboardInterrupt as stop:
        partial = f"interrupted ({stop or 'Ctrl-C'})"
    finally:
        stop_hogs(hogs)
        runner.close()
    text = report(runner, command, time.monotonic() - start, drawn, partial, args.hogs)
    print(text)
    if not args.no_report:
        write_block(REPORT, "fuzz-report", command, text)


if __name__ == "__main__":
    main()
