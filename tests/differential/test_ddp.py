"""fanfold's DistributedDataParallel against torch's, in the same rank processes on the same process group, over
configurations hypothesis draws (``config.py``); ZeRO stages 1 and 2 against torch's optimizer on the whole batch.

A bounded, derandomized budget runs in ``make test``; ``make fuzz`` runs the same strategies on named seeds for
thousands of configurations (``fuzz.py``). Every configuration that ever failed is kept below as an ``@example``.
The outcomes and the tolerances are in ``compare.py``; docs/differential.md says what is drawn and how.
"""
from hypothesis import HealthCheck, Phase, event, example, given, settings

from .config import DDPConfig, ZeroConfig, ddp_configs, zero_configs

# Bounded for `make test` (about 1.5 minutes on two cores): fixed draws, no example database in the tree, no
# shrinking (a hang costs the time limit per try; `fuzz.py --shrink` shrinks a failure found there).
BUDGET = settings(deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=list(HealthCheck))
PASSING = ("match", "match-oracle", "both-raise", "known-defect")


def check(runner, config) -> None:
    outcome = runner.run(config)
    event(outcome.kind)
    assert outcome.kind in PASSING, f"{outcome.kind}: {outcome.detail}\n{config!r}"


# Regressions: every configuration that failed once (the fix named beside it).
@example(config=DDPConfig(world=3, dtype="float32", backend="fanfold", transport=None, family="conv_bn"))
@example(config=DDPConfig(family="sparse_embedding", hook="allreduce", accumulate=2))
@example(config=DDPConfig(family="branch_rank", keywords=(("find_unused_parameters", True),), join="initial",
                          batches=(2, 1)))
@example(config=DDPConfig(keywords=(("mixed_precision", "bfloat16"),)))
@example(config=DDPConfig(lifetime="pickle", steps=3, transport="torch"))
@settings(BUDGET, max_examples=70)
@given(config=ddp_configs(compile_p=0.0))
def test_fanfold_ddp_matches_torch_ddp(runner, config):
    check(runner, config)


@example(config=ZeroConfig(stage=2))
@example(config=ZeroConfig(stage=1, world=3, optimizer="adam"))
@settings(BUDGET, max_examples=12)
@given(config=zero_configs())
def test_zero_matches_torch_optimizer_on_the_whole_batch(runner, config):
    check(runner, config)
