"""GRPO: group-relative advantages, PPO clip and a k3 KL-to-reference loss (DeepSeekMath, arXiv 2402.03300)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyGradient, PolicyGradientConfig, Rollout, broadcast
from alignflow.core.rl.parts import group_normalize


class GRPOConfig(PolicyGradientConfig):
    kl_loss_coef: float = Field(0.04, ge=0.0)  # beta of the paper
    loss_agg_mode: AggMode = "seq-mean-token-mean"  # the paper's (1/G) sum_i (1/|o_i|) sum_t
    scale_rewards: bool = True  # divide by the group's std (unbiased, N-1, as verl)


class GRPO(PolicyGradient):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300): A_i = (R_i - mean) / std within the prompt's group.

    Loss: the clipped surrogate plus beta * k3(pi_theta, pi_ref) per token, averaged per response then over
    responses. As in the paper and verl (and TRL before 1.16) the k3 term is not importance-weighted by default:
    it is evaluated on pi_old's samples and its expected gradient is that of KL(pi_ref || pi_theta), even
    on-policy. `kl_loss_bias_correction: true` weights it by r = pi_theta / pi_old, TRL 1.16's default
    (`use_bias_correction_kl`), whose gradient is that of KL(pi_theta || pi_ref) (`KLLossConfig`).
    """

    Config: ClassVar[type[GRPOConfig]] = GRPOConfig
    requires_reference: ClassVar[bool] = True

    def advantages(self, rollout: Rollout):
        scores = group_normalize(rollout.rewards, rollout.group, scale=self.config.scale_rewards)
        return broadcast(scores, rollout.response_mask), None


@hookimpl
def register_algorithms(register):
    register("grpo", GRPO)
