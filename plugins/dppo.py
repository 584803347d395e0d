"""DPPO: a trust region on a direct estimate of the policy divergence, by masking tokens (Qi et al. 2026,
"Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import KLLossConfig, PolicyBatch, with_kl_loss
from alignflow.core.rl.parts import LOG_RATIO_CLAMP, masked_mean
from alignflow.plugins.grpo import GRPO

DEFAULT_DELTA = {"tv": 0.2, "kl": 0.05}  # probability mass for TV, nats for KL
BERNOULLI_EPS = 1e-8  # inside the (1 - p) terms of the binary KL, as the official code


class DPPOConfig(KLLossConfig):  # kl_loss_coef 0: no KL-to-reference term in the official code
    divergence: Literal["tv", "kl"] = "tv"  # binary TV (the paper's Eq. 13) or binary KL (Eq. 14)
    # thresholds of the trust region; None: 0.2 for TV (the official code) and 0.05 for KL (its units are nats)
    delta_low: float | None = Field(None, gt=0.0)
    delta_high: float | None = Field(None, gt=0.0)  # the upper one; None: as delta_low
    # rollout: mu, the sampler's own log-probs (the paper, Sec. 5.2, and its code; pi_old when the sampler has
    # none); recompute: pi_old, the trainer's log-probs at theta_old (verl's default outside bypass mode)
    anchor: Literal["rollout", "recompute"] = "rollout"
    # C of the detached IS weight min(pi_theta / anchor, C): 3.0 as the official code (clip_ratio_c);
    # None leaves it untruncated (SkyRL, prime-rl)
    is_cap: float | None = Field(3.0, gt=0.0)
    loss_agg_mode: AggMode = "token-mean"  # the official code's
    scale_rewards: bool = True  # GRPO's group advantages: divide by the group's std

    def deltas(self) -> tuple[float, float]:
        """(delta_low, delta_high), the divergence's default where unset."""
        default = DEFAULT_DELTA[self.divergence]
        return (self.delta_low or default, self.delta_high or default)


def binary_kl(p_mu: Tensor, p: Tensor) -> Tensor:
    """KL(Bern(p_mu) || Bern(p)): the divergence of the two policies restricted to {sampled token, the rest}."""
    return p_mu * (p_mu.log() - p.log()) + (1 - p_mu) * ((1 - p_mu + BERNOULLI_EPS) / (1 - p + BERNOULLI_EPS)).log()


def trust_region_mask(logprobs: Tensor, anchor: Tensor, advantages: Tensor, divergence: str,
                      delta_low: float, delta_high: float) -> Tensor:
    """[b, T] bool, detached: True where the token leaves the trust region in its advantage's direction.

    TV: A > 0 and p - p_mu > delta_high, or A <= 0 and p - p_mu < -delta_low. KL: A > 0, p > p_mu and
    D > delta_high, or A <= 0, p < p_mu and D > delta_low, D the binary KL. A token moving against its
    advantage is never masked (as PPO's min)."""
    with torch.no_grad():
        # fp32 at least (binary KL is ill-conditioned near 1), fp64 when given: a decision within 6e-8 of delta
        # would otherwise depend on float32 rounding
        dtype = torch.promote_types(torch.promote_types(logprobs.dtype, anchor.dtype), torch.float32)
        p, p_mu = logprobs.to(dtype).exp(), anchor.to(dtype).exp()
        positive = advantages > 0
        if divergence == "tv":
            return torch.where(positive, p - p_mu > delta_high, p - p_mu < -delta_low)
        d = binary_kl(p_mu, p)
        return torch.where(positive, (d > delta_high) & (p > p_mu), (d > delta_low) & (p < p_mu))


class DPPO(GRPO):
    """DPPO (Qi et al. 2026, arXiv 2602.04879): per-token loss -M_t sg(min(r_t, C)) A_t log pi_theta, with
    r_t = pi_theta / mu and M_t = 0 where the token left the trust region (`trust_region_mask`), else 1.

    Its gradient is -M_t A_t grad r_t while r_t < C: PPO's ratio clip is replaced by a mask on a direct
    estimate of TV or KL between pi_theta and the sampling policy mu (the paper's binary approximation,
    {sampled token, rest}). The paper anchors on mu, the sampler's log-probs, and so does the official
    code; verl anchors on the recomputed pi_old: `anchor: recompute`. Defaults of the official code
    (Stable-RL): delta 0.2, C 3.0, token-mean, no KL; GRPO's group advantages. The paper's Top-K variant
    (Eqs. 15-16) needs the sampler's top-K log-probs and is not here (its Sec. G.2: no significant gain).
    """

    Config: ClassVar[type[DPPOConfig]] = DPPOConfig
    requires_reference: ClassVar[bool] = False

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        c, mask, adv = self.config, batch.response_mask, batch.advantages
        use_sampler = c.anchor == "rollout" and batch.sampler_logprobs is not None
        anchor = batch.sampler_logprobs if use_sampler else batch.old_logprobs
        ratio = (batch.logprobs.detach() - anchor).clamp(max=LOG_RATIO_CLAMP).exp()
        weight = ratio if c.is_cap is None else ratio.clamp(max=c.is_cap)
        outside = trust_region_mask(batch.logprobs, anchor, adv, c.divergence, *c.deltas())
        loss = -(~outside).to(weight.dtype) * weight * adv * batch.logprobs
        metrics = {
            "actor/trust_region_masked_frac": masked_mean(outside.float(), mask),
            "actor/ratio_mean": masked_mean(ratio, mask),
        }
        if c.is_cap is not None:
            metrics["actor/is_capped_frac"] = masked_mean((ratio > c.is_cap).float(), mask)
        return with_kl_loss(loss, batch, c, metrics)


@hookimpl
def register_algorithms(register):
    register("dppo", DPPO)
