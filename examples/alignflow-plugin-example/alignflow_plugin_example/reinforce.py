"""REINFORCE with a batch-mean baseline, as a third-party RL algorithm: the whole file it takes."""

from typing import ClassVar

from alignflow.core import AggMode, PolicyGradient, PolicyGradientConfig, Rollout, broadcast


class ReinforceConfig(PolicyGradientConfig):
    loss_agg_mode: AggMode = "seq-mean-token-sum"  # A_i * sum_t log pi(o_i,t), averaged over responses


class Reinforce(PolicyGradient):
    """REINFORCE with a batch-mean baseline (Williams 1992): A_i = R_i - mean_j R_j over the whole batch."""

    Config: ClassVar[type[ReinforceConfig]] = ReinforceConfig
    requires_reference: ClassVar[bool] = False

    def advantages(self, rollout: Rollout):
        rewards = rollout.rewards.float()
        return broadcast(rewards - rewards.mean(), rollout.response_mask), None
