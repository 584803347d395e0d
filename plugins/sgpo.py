"""SGPO: all-negative groups graded by a step-wise judge, then GRPO (Chen et al., arXiv 2505.11595)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import Rollout, broadcast
from alignflow.core.rl.parts import group_ids, group_normalize, group_sum
from alignflow.plugins.grpo import GRPO, GRPOConfig


class SGPOConfig(GRPOConfig):
    # A step whose judge score is below this is the first incorrect step: 0.5 on the `prm` reward's P(correct)
    # (Math-Shepherd's hard labels call a step correct when its completions can still reach the answer).
    step_threshold: float = 0.5
    # The graded score's ceiling, below the verifier's 1 for a correct answer. Under GRPO's std scaling it
    # cancels (up to eps): it matters with scale_rewards false or beside other reward terms.
    scale: float = Field(0.5, gt=0.0, lt=1.0)


def correct_prefix(step_rewards: Tensor, step_mask: Tensor, threshold: float) -> Tensor:
    """[B] (steps before the first step scored below `threshold`) / (steps); every step passes: 1; no step: 0."""
    steps = step_mask.bool()
    wrong = steps & (step_rewards < threshold)
    before = wrong.long().cumsum(-1) == 0  # positions before the first wrong step's end
    passed = (steps & before).sum(-1).float()
    return passed / steps.sum(-1).clamp(min=1).float()


class SGPO(GRPO):
    """SGPO (Chen, Li, Li, Chen, Lin, "Stepwise Guided Policy Optimization: Coloring your Incorrect Reasoning in
    GRPO", v1 "Spectral Policy Optimization", arXiv 2505.11595, TMLR 2026): GRPO that learns from groups whose G
    responses are all wrong (all-negative groups, where GRPO's advantages are 0) by grading each wrong response
    with a step-wise judge.

    In a group with no correct response, response i gets R_i + scale * k_i / n_i, where n_i is the number of its
    steps the judge scored and k_i the number before its first incorrect step (the first step whose score is below
    `step_threshold`; k_i = n_i when none is, 0 / 0 := 0 for a response with no step). Groups with a correct
    response keep their rewards. Then GRPO throughout: A_i = (R'_i - mean) / (std + eps) in the prompt's group,
    clipped surrogate, k3 KL. The judge is the stage's one step-scoring reward (the `prm` reward's P(step
    correct), from `Rollout.step_rewards`); `Rollout.correct` (the accuracy reward) says which groups are
    all-negative. The paper's text beyond its abstract could not be read here, so its exact score is not
    followed: the graded score (the fraction of steps before the first error, as a survey describes it), its
    ceiling `scale` < 1 (a correct answer always outranks it), adding it to R_i (for the 0/1 verifier this
    replaces the 0), the threshold and the steps (the PRM's step separator) are this file's choices.
    """

    Config: ClassVar[type[SGPOConfig]] = SGPOConfig
    requires_step_rewards: ClassVar[bool] = True

    def __init__(self, config: SGPOConfig | None = None):
        super().__init__(config)
        self.last_stats: dict[str, float] = {}  # the last rollout's group counts (`step_metrics`)

    def graded_rewards(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """[B] rewards with the judge's graded score added in all-negative groups, and [B] bool: in such a group."""
        if rollout.correct is None:
            raise DataError("sgpo finds all-negative groups by accuracy: the rl stage needs an accuracy reward "
                            "(such as math_accuracy)")
        if rollout.step_rewards is None or rollout.step_mask is None:
            raise DataError("sgpo grades wrong responses by their step scores: the rl stage needs one reward that "
                            "scores steps (such as prm)")
        inverse, n = group_ids(rollout.group)
        negative = (group_sum((rollout.correct > 0).float(), inverse, n) == 0)[inverse]
        graded = self.config.scale * correct_prefix(rollout.step_rewards, rollout.step_mask,
                                                    self.config.step_threshold)
        return rollout.rewards.float() + torch.where(negative, graded, torch.zeros_like(graded)), negative

    def advantages(self, rollout: Rollout):
        rewards, negative = self.graded_rewards(rollout)
        scores = group_normalize(rewards, rollout.group, scale=self.config.scale_rewards)
        inverse, n = group_ids(rollout.group)
        groups_negative = group_sum(negative.float(), inverse, n) > 0
        groups_live = group_sum((scores != 0).float(), inverse, n) > 0
        self.last_stats = {
            "sgpo/groups": float(n),
            "sgpo/all_negative_groups": groups_negative.sum().item(),
            "sgpo/graded_groups": (groups_negative & groups_live).sum().item(),  # non-zero advantages
            "sgpo/graded_score_mean": (rewards - rollout.rewards.float())[negative].mean().item()
            if negative.any() else 0.0,
        }
        return broadcast(scores, rollout.response_mask), None

    def step_metrics(self) -> dict[str, float]:
        return dict(self.last_stats)


@hookimpl
def register_algorithms(register):
    register("sgpo", SGPO)
