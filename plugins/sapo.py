"""SAPO: a smooth sigmoid gate on the importance ratio instead of a hard clip (Qwen, arXiv 2511.20347)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import KLLossConfig, PolicyBatch, RLAlgorithm, Rollout, broadcast, with_kl_loss
from alignflow.core.rl.parts import clamp_log_ratio, group_normalize, masked_mean


class SAPOConfig(KLLossConfig):
    tau_pos: float = Field(1.0, gt=0.0)  # gate temperature of tokens with A > 0 (paper, TRL, verl)
    # gate temperature of tokens with A <= 0: larger, so their updates fade faster off-policy (paper, TRL, verl)
    tau_neg: float = Field(1.05, gt=0.0)
    kl_loss_coef: float = Field(0.0, ge=0.0)  # the paper's objective has no KL term; TRL's beta is 0
    loss_agg_mode: AggMode = "seq-mean-token-mean"  # the paper's (1/G) sum_i (1/|o_i|) sum_t, as TRL and verl
    scale_rewards: bool = True  # GRPO's group advantages: divide by the group's std


def sapo_gate(ratio: Tensor, tau: Tensor | float) -> Tensor:
    """f(r) = sigmoid(tau (r - 1)) 4 / tau: f'(r) = 4 s (1 - s) is 1 at r = 1 and decays smoothly off it."""
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau


class SAPO(RLAlgorithm):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): per-token loss -f(r) A, tau = tau_pos if A > 0 else tau_neg.

    Its gradient is f'(r) r A grad log pi, with f'(1) = 1: on-policy it is the plain policy gradient, and off-policy
    the weight fades with |r - 1| instead of dropping to zero at a clip bound. GRPO's group advantages.
    """

    Config: ClassVar[type[SAPOConfig]] = SAPOConfig
    applies_policy_weights: ClassVar[bool] = True  # in `with_kl_loss`

    def uses_reference(self) -> bool:
        return self.config.kl_loss_coef > 0

    def advantages(self, rollout: Rollout):
        scores = group_normalize(rollout.rewards, rollout.group, scale=self.config.scale_rewards)
        return broadcast(scores, rollout.response_mask), None

    def loss(self, batch: PolicyBatch):
        c, mask, adv = self.config, batch.response_mask, batch.advantages
        ratio = clamp_log_ratio(batch.logprobs - batch.old_logprobs, c.log_ratio_clamp).exp()
        tau = torch.where(adv > 0, c.tau_pos, c.tau_neg).to(ratio.dtype)
        loss = -sapo_gate(ratio, tau) * adv
        s = torch.sigmoid(tau * (ratio.detach() - 1))
        metrics = {
            "actor/ratio_mean": masked_mean(ratio, mask),
            "actor/gate_weight_mean": masked_mean(4 * s * (1 - s), mask),  # f'(r): 1 on-policy, < 1 off it
        }
        return with_kl_loss(loss, batch, c, metrics)


@hookimpl
def register_algorithms(register):
    register("sapo", SAPO)
