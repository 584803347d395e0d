"""CISPO: clip the importance-sampling weight, not the update (MiniMax-M1, arXiv 2506.13585)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyBatch, with_kl_loss
from alignflow.core.rl.parts import clamp_log_ratio, masked_mean
from alignflow.plugins.grpo import GRPO, GRPOConfig


class CISPOConfig(GRPOConfig):
    # epsilon_low^IS: weight floor 1 - clip_low; None: no floor, as the paper ("set to a large value") and TRL
    clip_low: float | None = Field(None, ge=0.0)
    # epsilon_high^IS: weight cap 1 + clip_high = 5, TRL's recommended epsilon_high 5.0 (ScaleRL's eps_max);
    # the paper tunes it but does not publish its value
    clip_high: float = Field(4.0, ge=0.0)
    kl_loss_coef: float = Field(0.0, ge=0.0)  # the paper's objective has no KL term; TRL's beta is 0
    loss_agg_mode: AggMode = "token-mean"  # the paper's 1 / sum_i |o_i|
    dual_clip: float | None = Field(None, gt=1.0)  # must stay unset: CISPO never zeroes a token's gradient

    @field_validator("dual_clip")
    @classmethod
    def _no_dual_clip(cls, value):
        if value is not None:
            raise ValueError("cispo never zeroes a token's gradient, so dual_clip does not apply: leave it unset")
        return value


class CISPO(GRPO):
    """CISPO (MiniMax 2025, arXiv 2506.13585): per-token loss -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi.

    The weight is detached, so a token past the clip still gets the gradient w A grad log pi (PPO's clipped
    surrogate gives it none). GRPO's group advantages; token-mean over the whole optimizer step.
    TRL's `epsilon_high` for cispo is the cap itself (= 1 + clip_high) and it has no floor; verl clips at
    [1 - clip_ratio_low, 1 + clip_ratio_high] (0.8, 1.2 by default), which `clip_low=0.2, clip_high=0.2` gives.
    """

    Config: ClassVar[type[CISPOConfig]] = CISPOConfig
    requires_reference: ClassVar[bool] = False

    def loss(self, batch: PolicyBatch):
        c, mask = self.config, batch.response_mask
        ratio = clamp_log_ratio(batch.logprobs - batch.old_logprobs, c.log_ratio_clamp).detach().exp()
        floor = None if c.clip_low is None else 1 - c.clip_low
        weight = ratio.clamp(min=floor, max=1 + c.clip_high)
        loss = -weight * batch.advantages * batch.logprobs
        metrics = {
            "actor/clip_high_frac": masked_mean((ratio > 1 + c.clip_high).float(), mask),  # weight capped
            "actor/clip_low_frac": masked_mean((ratio < (floor or 0.0)).float(), mask),  # weight floored
            "actor/ratio_mean": masked_mean(ratio, mask),
        }
        return with_kl_loss(loss, batch, c, metrics)


@hookimpl
def register_algorithms(register):
    register("cispo", CISPO)
