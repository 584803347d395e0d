"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyGradient, PolicyGradientConfig, Rollout, broadcast
from alignflow.core.rl.parts import kl_estimate, leave_one_out


class RLOOConfig(PolicyGradientConfig):
    kl_coef: float = Field(0.05, ge=0.0)  # beta: R_i - beta * sum_t k1_t, before the baseline (TRL's RLOO)
    loss_agg_mode: AggMode = "seq-mean-token-sum"  # the paper's sequence-level REINFORCE: A_i * sum_t log pi


class RLOO(PolicyGradient):
    """RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740): A_i = R_i - mean_{j != i} R_j.

    R_i includes the sequence KL penalty -beta * sum_t (log pi_old - log pi_ref) when kl_coef > 0;
    `kl_loss_coef` adds a KL loss instead. With one PPO epoch and one step per rollout the ratio is 1 and
    the clipped surrogate is plain REINFORCE; with more it is PPO-clipped per token.
    """

    Config: ClassVar[type[RLOOConfig]] = RLOOConfig
    requires_reference: ClassVar[bool] = True

    def uses_reference(self) -> bool:
        return super().uses_reference() or self.config.kl_coef > 0

    def advantages(self, rollout: Rollout):
        rewards, mask = rollout.rewards.float(), rollout.response_mask
        if self.config.kl_coef > 0:
            kl = kl_estimate(rollout.old_logprobs, rollout.ref_logprobs, "k1") * mask
            rewards = rewards - self.config.kl_coef * kl.sum(-1)
        return broadcast(leave_one_out(rewards, rollout.group), mask), None


@hookimpl
def register_algorithms(register):
    register("rloo", RLOO)
