"""GDPO: each reward normalised within the group on its own, then summed and normalised over the batch (Liu et
al. 2026, NVIDIA, "GDPO: Group reward-Decoupled Normalization Policy Optimization", arXiv 2601.05242)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import Rollout, broadcast
from alignflow.core.rl.capabilities import RewardComponents
from alignflow.core.rl.parts import group_ids, group_sum
from alignflow.plugins.grpo import GRPO, GRPOConfig


class GDPOConfig(GRPOConfig):
    eps: float = Field(1e-4, ge=0.0)  # of both normalisations, as the official code (TRL fork); verl: 1e-6
    batch_normalize: bool = True  # the paper's last step; False stops at the weighted sum of the A_n


def group_standardize(values: Tensor, group: Tensor, eps: float) -> Tensor:
    """[B] (x - mean_g) / (std_g + eps) within each prompt's group, std unbiased (0 for a group of one)."""
    inverse, n = group_ids(group)
    count = group_sum(torch.ones_like(values), inverse, n)
    centred = values - (group_sum(values, inverse, n) / count)[inverse]
    std = (group_sum(centred**2, inverse, n) / (count - 1).clamp(min=1)).sqrt()
    return centred / (std[inverse] + eps)


def gdpo_advantages(values: Tensor, weights: Tensor, group: Tensor, eps: float = 1e-4,
                    batch_normalize: bool = True) -> Tensor:
    """[B] GDPO advantages from [B, K] reward values (NaN: the reward returned None, counted as 0) and K weights:
    A = sum_n w_n (r_n - mean_g r_n) / (std_g r_n + eps), then (A - mean_B A) / (std_B A + eps) over all B."""
    values = torch.nan_to_num(values.float(), nan=0.0)
    combined = sum(w * group_standardize(values[:, k], group, eps) for k, w in enumerate(weights.tolist()))
    if not batch_normalize:
        return combined
    centred = combined - combined.mean()
    std = (centred.pow(2).sum() / max(combined.numel() - 1, 1)).sqrt()
    return centred / (std + eps)


class GDPO(RewardComponents, GRPO):
    """GDPO (Liu et al. 2026, arXiv 2601.05242): for each of the stage's rewards n, A_n = (r_n - mean) / (std + eps)
    within the prompt's group; A = sum_n w_n A_n with the stage's reward weights; then A is standardised over
    the whole rollout (one value per response, unbiased std).

    Under GRPO on the summed reward, (1, 0) and (0, 1) get the same advantage ("reward advantage collapse");
    normalising each reward apart keeps them distinct, and the batch step keeps the scale from growing with the
    number of rewards (w then only matters relatively). With one reward it is GRPO plus batch whitening. As the
    official code (NVlabs/GDPO, TRL fork): eps 1e-4, a reward that returned None counts as 0, sequence-weighted
    batch statistics over the whole rollout (verl's port whitens per token). The loss is this project's GRPO
    (clip 0.2, k3 KL 0.04, seq-mean-token-mean); the paper's recipe ran TRL's GRPO loss.
    """

    Config: ClassVar[type[GDPOConfig]] = GDPOConfig

    def advantages(self, rollout: Rollout):
        c = self.config
        if rollout.reward_values is None:  # a rollout built without the stage: its total as the one reward
            values, weights = rollout.rewards[:, None], torch.ones(1)
        else:
            values, weights = rollout.reward_values, torch.tensor(rollout.reward_weights)
        scores = gdpo_advantages(values, weights, rollout.group, c.eps, c.batch_normalize)
        return broadcast(scores, rollout.response_mask), None


@hookimpl
def register_algorithms(register):
    register("gdpo", GDPO)
