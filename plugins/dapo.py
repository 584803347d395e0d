"""DAPO: clip-higher, dynamic sampling, token-level loss, no KL (ByteDance Seed, arXiv 2503.14476)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import Rollout
from alignflow.core.rl.capabilities import Regenerate
from alignflow.core.rl.parts import group_ids, group_sum
from alignflow.plugins.grpo import GRPO, GRPOConfig


class DAPOConfig(GRPOConfig):
    clip_high: float = Field(0.28, ge=0.0)  # clip-higher: eps_low 0.2, eps_high 0.28 (paper, section 3.1)
    kl_loss_coef: float = Field(0.0, ge=0.0)  # the paper drops the KL term (section 2.3)
    loss_agg_mode: AggMode = "token-mean"
    max_gen_batches: int = Field(10, ge=0)  # generation rounds to refill a filtered batch (verl recipe; 0: no cap)


class DAPO(Regenerate, GRPO):
    """DAPO (Yu et al. 2025, arXiv 2503.14476): GRPO advantages, clip-higher, dynamic sampling, token-mean loss.

    Dynamic sampling drops the groups whose accuracy (`Rollout.correct`, not the shaped reward) is 0 or 1; the
    stage regenerates until the batch is full. Token-mean normalises by the tokens of the whole optimizer step,
    as verl and TRL do, rather than per group as the paper's Eq. 8. A DAPO pipeline adds the `overlong` reward
    (soft overlong punishment, Eq. 13) next to the accuracy reward.
    """

    Config: ClassVar[type[DAPOConfig]] = DAPOConfig
    requires_reference: ClassVar[bool] = False

    @property
    def max_gen_batches(self) -> int:
        return self.config.max_gen_batches

    def filter_groups(self, rollout: Rollout):
        if rollout.correct is None:
            raise DataError("dapo filters groups on accuracy: the rl stage needs an accuracy reward (Rollout.correct)")
        inverse, n = group_ids(rollout.group)
        correct = rollout.correct.float()
        hits = group_sum(correct, inverse, n)[inverse]
        count = group_sum(torch.ones_like(correct), inverse, n)[inverse]
        # A group of one carries no comparison either way; verl keeps it, so do we.
        return ((hits > 0) & (hits < count)) | (count == 1)


@hookimpl
def register_algorithms(register):
    register("dapo", DAPO)
