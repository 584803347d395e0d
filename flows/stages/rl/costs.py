"""What some algorithms read beside the total reward in the `rl` stage: for `CostConstrained` algorithms (RePO)
a weight-0 reward's raw values as `Rollout.costs`; for `RewardComponents` algorithms (GDPO) every reward's,
`Rollout.reward_values`; for `EpisodeTurns` algorithms (GiGPO) each episode's turns and their states."""

from __future__ import annotations

from alignflow.core.errors import SpecError
from alignflow.core.rl.capabilities import (CostConstrained, EpisodeTurns, RewardComponents, cost_reward_problem,
                                            has)


def cost_label(algo) -> str | None:
    """The label of the reward whose raw values are the algorithm's costs; None without costs."""
    return algo.cost_reward if has(algo, CostConstrained) else None


def check_costs(ctx, algo) -> None:
    """Fail before any model loads when the stage's rewards cannot give the algorithm its costs, or the stage
    has no episodes for an `EpisodeTurns` algorithm."""
    if problem := cost_reward_problem(algo, ctx.spec.rewards):
        raise SpecError(f"stage {ctx.name!r}, {problem}")
    if has(algo, EpisodeTurns) and ctx.spec.environment is None:
        raise SpecError(f"stage {ctx.name!r}: algorithm {type(algo).__name__} learns from the turns of multi-turn "
                        "episodes; give the stage an `environment:` (or use grpo on single completions)")


def reward_components(algo, rewards) -> dict[str, float] | None:
    """{label: weight} of the stage's rewards (a `RewardSet`), in order, for a `RewardComponents` algorithm;
    None for any other."""
    return {r.name: r.weight for r in rewards.rewards} if has(algo, RewardComponents) else None


def turn_anchor(algo) -> str | None:
    """Which state hash of a turn an `EpisodeTurns` algorithm reads (its `anchor_state`); None for any other."""
    return algo.anchor_state if has(algo, EpisodeTurns) else None
