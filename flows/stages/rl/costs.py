"""Rewards apart from the total in the `rl` stage: for `CostConstrained` algorithms (RePO) a weight-0 reward's
raw values as `Rollout.costs`; for `RewardComponents` algorithms (GDPO) every reward's, `Rollout.reward_values`."""

from __future__ import annotations

from alignflow.core.errors import SpecError
from alignflow.core.rl.capabilities import CostConstrained, RewardComponents, cost_reward_problem, has


def cost_label(algo) -> str | None:
    """The label of the reward whose raw values are the algorithm's costs; None without costs."""
    return algo.cost_reward if has(algo, CostConstrained) else None


def check_costs(ctx, algo) -> None:
    """Fail before any model loads when the stage's rewards cannot give the algorithm its costs."""
    if problem := cost_reward_problem(algo, ctx.spec.rewards):
        raise SpecError(f"stage {ctx.name!r}, {problem}")


def reward_components(algo, rewards) -> dict[str, float] | None:
    """{label: weight} of the stage's rewards (a `RewardSet`), in order, for a `RewardComponents` algorithm;
    None for any other."""
    return {r.name: r.weight for r in rewards.rewards} if has(algo, RewardComponents) else None
