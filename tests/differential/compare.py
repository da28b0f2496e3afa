"""The verdict on one configuration: fanfold's DDP against torch's, or, where docs/ddp-compat.md lists a deviation,
against that deviation's own oracle (a one-process run over every rank's batches, or the documented refusal).

Outcomes: "match" (both ran, every gradient, parameter and buffer of every step on every rank agrees),
"match-oracle" (a listed deviation, and fanfold agrees with its oracle), "both-raise" (both raised, the steps both
finished agree), "DIFFER", "crash" (a rank died), "hang" (the time limit passed, or a collective timed out), and
"known-defect" (a draw that hits a defect fixed elsewhere, skipped: ``config.KNOWN_DEFECTS``).

Tolerances (issue 24): float64 bitwise at world size 2 and relative 1e-12 at 3 (gloo's summation order depends on
the bucket layout), float32 rtol 1e-5 plus atol 1e-6 x max|x|; looser only where both sides round on purpose
(a compression hook: its narrow type's precision) and against a one-process oracle (its own summation order).
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch

from .config import DDPConfig, ZeroConfig
from .models import batch, build, loss_of, uses_side
from .pool import Failure
from .ranks import _DTYPES, Run, _optimizer, delayed_params

OUTCOMES = ("match", "match-oracle", "both-raise", "DIFFER", "crash", "hang", "known-defect")
_TIMEOUTS = ("StallError", "ShmTimeoutError", "DistBackendError", "DistStoreError", "TimeoutError")


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float  # times ``scale``: max|expected| over the whole model's snapshot (a gradient that is zero but for
    # rounding, such as a bias before BatchNorm, is judged against the model's gradients, not against itself)

    def close(self, got: torch.Tensor, want: torch.Tensor, scale: float) -> bool:
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        if self.rtol == 0 and self.atol == 0:
            return torch.equal(got, want)
        g, w = got.double(), want.double()
        if not (torch.isfinite(g).all() and torch.isfinite(w).all()):
            return torch.equal(got, want)
        bound = self.atol * scale + self.rtol * w.abs()
        return bool(((g - w).abs() <= bound).all())

    def looser(self, other: Tolerance) -> Tolerance:
        return Tolerance(max(self.rtol, other.rtol), max(self.atol, other.atol))


def tolerance(config) -> Tolerance:
    world, dtype = config.world, config.dtype
    if dtype == "float64":
        exact = world == 2 and isinstance(config, DDPConfig) and config.family != "sparse_embedding" and \
            not (config.accumulate > 1 and "delay_all_reduce_named_params" in config.kw())
        tol = Tolerance(0.0, 0.0) if exact else Tolerance(1e-12, 1e-12)
    else:
        tol = Tolerance(1e-5, 1e-6)
    hook = getattr(config, "hook", None)
    if hook in ("fp16", "bf16"):  # both round to the narrow type, in their own order at world size 3
        eps = torch.finfo(torch.float16 if hook == "fp16" else torch.bfloat16).eps
        tol = tol.looser(Tolerance(0.0, 0.0) if world == 2 else Tolerance(4 * eps, 4 * eps))
    return tol


def oracle_tolerance(config) -> Tolerance:
    tol = tolerance(config).looser(Tolerance(1e-10, 1e-10) if config.dtype == "float64" else Tolerance(1e-5, 1e-5))
    mp = config.kw().get("mixed_precision") if isinstance(config, DDPConfig) else None
    if mp is not None:  # forward and backward in the narrow type, in a different order
        tol = tol.looser(Tolerance(5e-2, 5e-2) if mp.startswith("bfloat16") else Tolerance(1e-2, 1e-2))
    if getattr(config, "hook", None) in ("fp16", "bf16"):
        eps = torch.finfo(torch.float16 if config.hook == "fp16" else torch.bfloat16).eps
        tol = tol.looser(Tolerance(8 * eps, 8 * eps))
    return tol


def _first_difference(got: list[dict], want: list[dict], tol: Tolerance, what: str) -> str | None:
    for step, (g, w) in enumerate(zip(got, want)):
        if g.keys() != w.keys():
            return f"{what} step {step}: names {sorted(g)} != {sorted(w)}"
        scale = max((t.double().abs().max().item() for t in w.values() if t is not None and t.numel()), default=0.0)
        for name in w:
            a, b = g[name], w[name]
            if (a is None) != (b is None):
                return f"{what} step {step} {name}: {'None' if a is None else 'a tensor'} where the other has " \
                       f"{'None' if b is None else 'a tensor'}"
            if a is not None and not tol.close(a, b, scale):
                err = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
                return f"{what} step {step} {name}: max |diff| {err} (max |x| {b.abs().max().item():.3g}, " \
                       f"over the model {scale:.3g}, dtypes {a.dtype}/{b.dtype})"
    return None


def compare_runs(got: Run, want: Run, tol: Tolerance, buffers: bool = True) -> str | None:
    """The first disagreement between two runs of one rank, over the steps both finished."""
    if got.error is None and want.error is None:
        if len(got.params) != len(want.params):
            return f"{len(got.params)} steps != {len(want.params)}"
        if got.final is not None and want.final is not None:
            diff = _first_difference([got.final], [want.final], tol, "final parameters")
            if diff:
                return diff
    parts = [(got.grads, want.grads, "grad"), (got.params, want.params, "parameter")]
    if buffers:
        parts.append((got.buffers, want.buffers, "buffer"))
    for g, w, what in parts:
        diff = _first_difference(g, w, tol, what)
        if diff:
            return diff
    return None


def _is_timeout(error) -> bool:
    return error is not None and (error[0] in _TIMEOUTS or "timed out" in error[1].lower() or
                                  "timeout" in error[1].lower())


# ---- the deviations docs/ddp-compat.md lists ------------------------------------------------------------------

def _branchy_without_finder(c: DDPConfig) -> bool:
    kw = c.kw()
    return c.family.startswith("branch") and not kw.get("find_unused_parameters") and not kw.get("static_graph")


# Where torch raises on the CPU, or fails inside, and fanfold gives an answer: (name, when, words of torch's
# error). fanfold is then held to the one-process oracle (``simulate``).
TORCH_RAISES = (
    ("mixed_precision on the CPU", lambda c: "mixed_precision" in c.kw(), "support events"),
    ("bf16 compression hook on gloo", lambda c: c.hook == "bf16", "BF16 all reduce communication hook required"),
    ("device_ids or output_device for a CPU module",
     lambda c: "device_ids" in c.kw() or "output_device" in c.kw(), "device_ids and output_device arguments"),
    ("reentrant checkpointing with find_unused_parameters",
     lambda c: c.checkpointing == "reentrant" and c.kw().get("find_unused_parameters"),
     "mark a variable ready only once"),
    ("torch's internal assertion", lambda c: True, "INTERNAL ASSERT FAILED"),
    # gloo aborts the process on a collective mismatch ("Is there a distributed collective mismatch"): torch's DDP
    # with skip_all_reduce_unused_params inside join(), which fanfold refuses
    ("torch's run crashed or hung the rank", lambda c: c.backend == "gloo", "torch's run:"),
    # torch's own mixed precision registers a built-in hook; fanfold's takes a comm hook too
    ("a comm hook with mixed_precision", lambda c: "mixed_precision" in c.kw() and c.hook,
     "register_comm_hook or register_builtin_comm_hook can only be called once"),
    # torch's buffer for the delayed parameters is float32 whatever the parameters' dtype
    ("delay_all_reduce_named_params with float64 parameters",
     lambda c: "delay_all_reduce_named_params" in c.kw() and c.dtype == "float64",
     "attempting to assign a gradient with dtype 'float'"),
    # torch's DDP under join() with find_unused_parameters + static_graph all-reduces the unused-parameter bitmap
    # on the active rank where the joined one all-reduces join's count: on gloo a hang or an abort, on the fanfold
    # group the shm transport names the mismatch
    ("torch's DDP issued mismatched collectives under join()", lambda c: c.join and c.backend == "fanfold",
     "every rank must issue the same collectives"),
    # torch's mixed precision with sparse gradients fails in its own cast of the gradients
    ("mixed_precision with sparse gradients",
     lambda c: "mixed_precision" in c.kw() and c.family == "sparse_embedding",
     "Expected a proper Tensor but got None"),
    # dynamo's DDPOptimizer takes the first bucket's cap as 1 MiB and asserts that bucket_cap_mb is no smaller
    ("torch.compile with buckets under 1 MiB", lambda c: c.compiled, "First bucket should be smaller/equal"),
)
# What fanfold refuses where torch may not, each documented: (name, when, words of fanfold's error).
FANFOLD_REFUSES = (
    ("join() with skip_all_reduce_unused_params", lambda c: c.join and c.kw().get("skip_all_reduce_unused_params"),
     "join() with skip_all_reduce_unused_params"),
    # a branch used on some steps only: the static graph changed (both raise at the next forward, torch's words)
    ("a static graph that changes", lambda c: c.kw().get("static_graph") and c.family == "branch_step",
     "training graph has changed in this iteration"),
    # torch's own refusal (fanfold's too, with torch's words), also where torch raised earlier for another reason
    ("pickling with a process group other than the default",
     lambda c: c.lifetime in ("pickle", "deepcopy") and ("process_group" in c.kw() or "device_mesh" in c.kw()),
     "only supported when using DDP with the default process group"),
    # both hand back un-averaged gradients and raise at the next forward (or never, after the last step)
    ("a parameter no rank used, without find_unused_parameters", _branchy_without_finder,
     "Expected to have finished reduction in the prior iteration"),
)


# Where torch's answer is wrong and fanfold's is the one-process result: (name, when). fanfold is then held to the
# oracle whatever torch does.
TORCH_WRONG = (
    # torch's hook on param_to_hook_all_reduce launches the delayed parameters' all-reduce and never waits for it: on
    # a busy machine backward can return before gloo has written the average, so the optimizer steps on this rank's
    # own gradient divided by the world size (not a compression hook on sparse gradients: both raise at step 0)
    ("delay_all_reduce_named_params (torch never waits for their all-reduce)",
     lambda c: "delay_all_reduce_named_params" in c.kw() and
     not (c.family == "sparse_embedding" and c.hook in ("fp16", "bf16"))),
    # torch's __setstate__ registers no hook for the delayed parameters: after the copy they are never averaged
    ("delay_all_reduce_named_params after pickling or deepcopy",
     lambda c: c.lifetime in ("pickle", "deepcopy") and "delay_all_reduce_named_params" in c.kw()),
    # torch's copy observes a "first iteration" again and hands back gradients that differ from rank to rank
    ("static_graph after pickling or deepcopy",
     lambda c: c.lifetime in ("pickle", "deepcopy") and c.kw().get("static_graph")),
    # torch's copy builds a new C++ reducer and leaves the registered comm hook behind: the copy all-reduces
    # without it (a user's scaling, a compression's rounding lost); fanfold's copy keeps the hook and its state
    # (not a compression hook on sparse gradients: both raise at the first step, before any copy)
    ("a comm hook after pickling or deepcopy",
     lambda c: c.lifetime in ("pickle", "deepcopy") and c.hook is not None and c.steps > 1 and
     not (c.family == "sparse_embedding" and c.hook in ("fp16", "bf16"))),
    # inside join(), a parameter none of the active ranks used gets zeros from torch (so momentum moves it);
    # fanfold leaves it None, as one process would
    ("join() with find_unused_parameters and a branch",
     lambda c: c.join and c.kw().get("find_unused_parameters") and c.family.startswith("branch")),
)


def _matching(table, config: DDPConfig, errors: list) -> str | None:
    text = " ".join(e[1] for e in errors if e)
    return next((name for name, when, words in table if words in text and when(config)), None)


def _unfinished_step(c: DDPConfig) -> int | None:
    """The first step whose reduction cannot finish (torch's DDP and fanfold's hand back un-averaged gradients and
    raise at the next forward), which the one-process oracle does not model: a branch unused without
    find_unused_parameters, or a static graph's branch used in the first step only."""
    kw = c.kw()
    if c.family not in ("branch_step", "branch_never"):
        return None
    if kw.get("static_graph"):  # find_unused_parameters or not: the first iteration fixed the graph
        return 1 if c.family == "branch_step" else None
    if kw.get("find_unused_parameters"):
        return None
    return 0 if c.family == "branch_never" else 1


def _until(run: Run, stop: int | None) -> Run:
    if stop is None:
        return run
    return dataclasses.replace(run, grads=run.grads[:stop], params=run.params[:stop], buffers=run.buffers[:stop],
                               final=None)


def _against_oracle(name: str, config: DDPConfig, results: list) -> Outcome:
    stop = _unfinished_step(config)
    fan = [_until(r.runs["fanfold"], stop) for r in results]
    expected = simulate(config)
    if not isinstance(expected, tuple):
        expected = [_until(run, stop) for run in expected]
    if isinstance(expected, tuple):  # the oracle itself raises (an operator without a half kernel): so may fanfold
        if all(run.error for run in fan):
            return Outcome("both-raise", f"{name}: oracle {expected[0]}, fanfold {fan[0].error[0]}")
        return Outcome("DIFFER", f"{name}: the one-process oracle raises {expected} but fanfold does not")
    tol = oracle_tolerance(config)
    for r, run in zip(results, fan):
        if run.error:
            return Outcome("DIFFER", f"{name}: rank {r.rank}: fanfold raised {run.error[0]} at step {run.error[2]}: "
                                     f"{run.error[1][:500]} where the one-process oracle runs")
        diff = compare_runs(run, expected[r.rank], tol, buffers=False)
        if diff:
            return Outcome("DIFFER", f"{name}: rank {r.rank} against the one-process oracle: {diff}")
    return Outcome("match-oracle", name)


def _torch_failed(config, failure: Failure) -> list | None:
    """When a rank died or hung in torch's run, after fanfold's had finished on every rank: the results with that
    failure as torch's error, to be judged like any error of torch's; else None."""
    done = [r for r in failure.results if "fanfold" in r.runs]
    # on the fanfold backend torch's run goes through fanfold's collectives: its crash or hang is fanfold's
    if not isinstance(config, DDPConfig) or len(done) != config.world or config.backend != "gloo" or \
            not any(r.running == "torch" for r in failure.results):
        return None
    for r in failure.results:
        if "torch" not in r.runs:
            r.runs["torch"] = Run(error=(f"Torch{failure.kind.title()}", f"torch's run: {failure.detail}", 0))
    return failure.results


def classify(config, results) -> Outcome:
    if isinstance(results, Failure):
        partial = _torch_failed(config, results)
        if partial is None:
            where = sorted({r.running for r in results.results if r.running})
            return Outcome(results.kind, f"{results.detail} in {'/'.join(where) or 'set-up'}'s run")
        results = partial
    if isinstance(config, DDPConfig):
        # a documented refusal on one rank may leave the others waiting for it: the refusal is the outcome
        refusal = _matching(FANFOLD_REFUSES, config, [r.runs["fanfold"].error for r in results])
        if refusal is not None:
            raised = any(r.runs["torch"].error for r in results)
            return Outcome("both-raise" if raised else "match-oracle", f"fanfold refuses: {refusal}")
    for res in results:
        for impl, run in res.runs.items():
            if _is_timeout(run.error) and impl == "torch" and config.backend == "gloo":  # torch's own hang
                run.error = ("TorchHang", f"torch's run: {run.error[0]}: {run.error[1]}", run.error[2])
            elif _is_timeout(run.error):
                return Outcome("hang", f"rank {res.rank}, {impl}: {run.error[0]}: {run.error[1][:500]}")
    if isinstance(config, ZeroConfig):
        return _classify_zero(config, results)
    torch_errors = [r.runs["torch"].error for r in results]
    fanfold_errors = [r.runs["fanfold"].error for r in results]
    t_raised, f_raised = any(torch_errors), any(fanfold_errors)
    cannot = _matching(TORCH_RAISES, config, torch_errors) or next(
        (name for name, when in TORCH_WRONG if when(config)), None)
    if cannot is not None:
        return _against_oracle(cannot, config, results)
    if t_raised != f_raised:
        who, err = ("torch", next(e for e in torch_errors if e)) if t_raised else \
            ("fanfold", next(e for e in fanfold_errors if e))
        return Outcome("DIFFER", f"only {who} raised, at step {err[2]}: {err[0]}: {err[1][:800]}")
    tol = tolerance(config)
    # A reduction that cannot finish, with bucket views: torch launches the buckets that are ready and never waits
    # for them, so gloo's all-reduce writes the average into .grad (the bucket) whenever it completes, before or
    # during the optimizer's step (5 runs of one configuration, 3 different gradients). Compared until that step.
    racy = _unfinished_step(config) if config.kw().get("gradient_as_bucket_view") else None
    for res in results:
        diff = compare_runs(_until(res.runs["fanfold"], racy), _until(res.runs["torch"], racy), tol)
        if diff:
            return Outcome("DIFFER", f"rank {res.rank}: {diff}")
    if t_raised:
        return Outcome("both-raise", f"torch {_kinds(torch_errors)}, fanfold {_kinds(fanfold_errors)}")
    return Outcome("match")


def _kinds(errors: list) -> str:
    return "/".join(sorted({e[0] for e in errors if e}))


# ---- one-process oracles ----------------------------------------------------------------------------------------

def simulate(config: DDPConfig) -> list[Run] | tuple:
    """The training DDP should do, in one process: each rank's replica (a copy of the master, its parameters cast to
    mixed precision's type, its buffers not) runs its own batches; the gradients are averaged over the ranks (over
    those still training with join's divide_by_initial_world_size=False), zeros for a parameter a rank did not use,
    None where none did; the optimizer steps the master. Per rank a Run, or (exception type, message) if the
    oracle raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _simulate(config)
    except Exception as exc:  # noqa: BLE001 -- e.g. an operator without a float16 kernel on the CPU
        return type(exc).__name__, str(exc)[:500]


def _simulate(config: DDPConfig) -> list[Run]:
    kw, dtype = config.kw(), _DTYPES[config.dtype]
    mp = kw.get("mixed_precision")
    low, _, reduce = (mp or "").partition("/")
    low_dtype = _DTYPES[low] if low else dtype
    reduce_dtype = _DTYPES[reduce] if reduce else low_dtype
    master = build(config.family, dtype, config.seed, config.checkpointing, config.output, config.frozen)
    replicas = [_low_precision_replica(master, low_dtype) for _ in range(config.world)]
    opt = _optimizer(config.optimizer, master)
    steps = [config.rank_steps(r) for r in range(config.world)]
    runs = [Run() for _ in range(config.world)]
    named = dict(master.named_parameters())
    delayed = {n for n, _ in delayed_params(master)} if "delay_all_reduce_named_params" in kw else set()
    for step in range(max(steps)):
        active = [r for r in range(config.world) if step < steps[r]]
        # a comm hook divides as it likes (torch's: by the world size), whatever join was told; so does torch's
        # all-reduce of the delayed parameters
        joined = len(active) if config.join == "active" else config.world
        divisor = joined if config.hook is None else config.world
        grads: dict[str, list] = {n: [] for n in named}
        for r in active:
            rep = replicas[r]
            with torch.no_grad():
                for n, p in rep.named_parameters():
                    p.copy_(named[n])
                    p.grad = None
            for micro in range(config.accumulate):
                x, y = batch(config.family, dtype, config.seed, r, step, micro)
                x = x.to(low_dtype) if x.is_floating_point() else x
                loss_of(rep(x, use_side=uses_side(config.family, r, step)), y).backward()
            for n, p in rep.named_parameters():
                if p.grad is not None:
                    g = p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad
                    grads[n].append(g.to(reduce_dtype))
        for n, p in named.items():
            if not p.requires_grad or not grads[n]:
                continue
            scale = 0.5 if config.hook == "user" and n not in delayed else 1.0
            avg = (sum(grads[n]) / (config.world if n in delayed else divisor) * scale).to(dtype)
            p.grad = avg if p.grad is None or config.set_to_none else p.grad.copy_(avg)
        snapshot_grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in named.items()}
        opt.step()
        opt.zero_grad(set_to_none=config.set_to_none)
        if config.lifetime in ("pickle", "deepcopy") and step == 0:
            # the ranks go on with a copy of the wrapper: a copied Parameter carries no .grad (pickle and
            # Parameter.__deepcopy__ drop it), so zero_grad(set_to_none=False)'s zeros are gone too, and a
            # parameter no rank uses next keeps grad None (Adam skips it)
            for p in named.values():
                p.grad = None
        params = {n: p.detach().clone() for n, p in named.items()}
        for r in active:
            runs[r].grads.append(snapshot_grads)
            runs[r].params.append(params)
    for run in runs:
        run.final = {n: p.detach().clone() for n, p in named.items()}
    return runs


def _low_precision_replica(master: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``master`` whose floating-point parameters are in ``dtype``, its buffers as they are: torch's
    ``_MixedPrecision(param_dtype)`` casts the parameters for forward and backward and the buffers only when given a
    ``buffer_dtype`` (``_cast_buffers`` with ``None`` keeps their dtype), which these draws never give. So a
    BatchNorm's running statistics stay in the model's dtype and its CPU kernel refuses a bfloat16 input with them,
    under torch's DDP as under fanfold's."""
    replica = copy.deepcopy(master)
    for p in replica.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return replica


def _classify_zero(config: ZeroConfig, results: list) -> Outcome:
    errors = [r.runs["fanfold"].error for r in results]
    want = zero_oracle(config)
    if any(errors):
        err = next(e for e in errors if e)
        return Outcome("DIFFER", f"fanfold raised at step {err[2]}: {err[0]}: {err[1][:800]}")
    tol = tolerance(config).looser(Tolerance(1e-10, 1e-10) if config.dtype == "float64" else Tolerance(1e-5, 1e-5))
    for res in results:
        diff = _first_difference(res.runs["fanfold"].params, want, tol, "parameter")
        if diff:
            return Outcome("DIFFER", f"rank {res.rank} against torch's optimizer on the whole batch: {diff}")
    return Outcome("match-oracle", f"ZeRO stage {config.stage}")


def zero_oracle(config: ZeroConfig) -> list[dict]:
    """torch's optimizer on one model over every rank's batch (the mean of the ranks' losses), in one process."""
    dtype = _DTYPES[config.dtype]
    model = build(config.family, dtype, config.seed)
    opt = _optimizer(config.optimizer, model)
    out = []
    for step in range(config.steps):
        loss = sum(loss_of(model(x), y) for x, y in
                   (batch(config.family, dtype, config.seed, r, step) for r in range(config.world)))
        (loss / config.world).backward()
        opt.step()
        opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out
