"""GRPO with process supervision (DeepSeekMath, arXiv 2402.03300, section 4.1.3): step rewards from a PRM."""

from __future__ import annotations

import torch

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import Rollout
from alignflow.core.rl.parts import group_normalize
from alignflow.plugins.grpo import GRPO


class ProcessGRPO(GRPO):
    """GRPO whose advantages come from a process reward model's step scores, not the outcome reward.

    Each step reward r_i^index(j) (at the last token of step j of response i) is normalised by the mean
    and std of every step reward of the prompt's G responses; a token's advantage is the sum of the
    normalised rewards of the steps ending at or after it: A_{i,t} = sum_{index(j) >= t} r~_i^index(j).
    Tokens after the last step (the EOS) get 0. The stage takes the step rewards from the one reward
    with `step_rewards` among the stage's rewards (the `prm` reward); the loss is GRPO's.
    """

    requires_step_rewards = True

    def advantages(self, rollout: Rollout):
        at_step = rollout.step_mask.bool()
        rows = torch.arange(at_step.shape[0], device=at_step.device)[:, None].expand_as(at_step)[at_step]
        normalised = torch.zeros_like(rollout.step_rewards, dtype=torch.float32)
        normalised[at_step] = group_normalize(rollout.step_rewards[at_step], rollout.group[rows],
                                              scale=self.config.scale_rewards)
        to_go = normalised.flip(-1).cumsum(-1).flip(-1)  # sum over the steps ending at or after t
        return to_go * rollout.response_mask, None


@hookimpl
def register_algorithms(register):
    register("grpo_process", ProcessGRPO)
