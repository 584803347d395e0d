"""NGRPO: a virtual max-reward sample in the group statistics, asymmetric clipping (Nan et al., arXiv 2509.18851)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import PolicyGradient, PolicyGradientConfig, Rollout, broadcast
from alignflow.core.rl.capabilities import Regenerate
from alignflow.core.rl.parts import group_ids, group_sum


class NGRPOConfig(PolicyGradientConfig):
    clip_low: float = Field(0.16, ge=0.0, lt=1.0)  # stricter for A < 0 (official script: clip_ratio_low)
    clip_high: float = Field(0.24, ge=0.0)  # looser for A > 0 (clip_ratio_high)
    kl_loss_coef: float = Field(0.0, ge=0.0)  # official script: no KL
    loss_agg_mode: AggMode = "token-mean"  # the official script's
    max_reward: float = 1.0  # r_max, the virtual samples' reward (official `max_reward`)
    virtual_samples: int = Field(1, ge=0)  # K (official `add_max_reward_num`); 0 is GRPO's advantage
    eps: float = Field(1e-6, gt=0.0)  # added to the calibrated std before dividing by it
    # The official script also drops all-correct groups (advantage 0 anyway) and refills the batch, as
    # DAPO's dynamic sampling; the paper's method keeps every group, so this is off by default.
    filter_all_correct: bool = False
    max_gen_batches: int = Field(10, ge=0)  # refill rounds when filtering (official max_num_gen_batches)


def calibrated_advantages(rewards: Tensor, group: Tensor, max_reward: float, k: int, eps: float) -> Tensor:
    """[B] (R_i - mu') / (sigma' + eps), mu' and unbiased sigma' over the group's G rewards and k copies of
    max_reward. The virtual samples enter the statistics only: they get no advantage and no gradient."""
    inverse, n = group_ids(group)
    rewards = rewards.float()
    count = group_sum(torch.ones_like(rewards), inverse, n) + k
    mean = (group_sum(rewards, inverse, n) + k * max_reward) / count
    centred = rewards - mean[inverse]
    squares = group_sum(centred**2, inverse, n) + k * (max_reward - mean) ** 2
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return centred / (std[inverse] + eps)


class NGRPO(Regenerate, PolicyGradient):
    """NGRPO (Nan et al. 2025, arXiv 2509.18851): advantage calibration and asymmetric clipping, token-mean, no KL.

    Each group's mean and unbiased std are taken over its G rewards plus K virtual samples of reward r_max,
    so an all-wrong 0/1 group (G = 8, K = 1: mu' = 1/9, sigma' = 1/3) gives every response A = -1/3 instead of
    0, an all-correct group gives 0, and mixed groups shift down. The clipped surrogate is PPO's with
    eps_low 0.16 < eps_high 0.24 (negative-advantage updates held tighter). Following the official code
    (verl fork, `compute_ngrpo_outcome_advantage`) and its training script; one deviation: a response alone
    in its group is normalised with the virtual samples like any other (the code gives it mean 0, std 1).
    """

    Config: ClassVar[type[NGRPOConfig]] = NGRPOConfig

    @property
    def max_gen_batches(self) -> int:
        return self.config.max_gen_batches if self.config.filter_all_correct else 1

    def filter_groups(self, rollout: Rollout) -> Tensor:
        if not self.config.filter_all_correct:
            return super().filter_groups(rollout)
        if rollout.correct is None:
            raise DataError("ngrpo's filter_all_correct reads accuracy: the rl stage needs an accuracy reward")
        inverse, n = group_ids(rollout.group)
        correct = rollout.correct.float()
        hits = group_sum(correct, inverse, n)[inverse]
        return hits < group_sum(torch.ones_like(correct), inverse, n)[inverse]

    def advantages(self, rollout: Rollout):
        c = self.config
        scores = calibrated_advantages(rollout.rewards, rollout.group, c.max_reward, c.virtual_samples, c.eps)
        return broadcast(scores, rollout.response_mask), None


@hookimpl
def register_algorithms(register):
    register("ngrpo", NGRPO)
