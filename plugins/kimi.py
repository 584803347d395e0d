"""Kimi k1.5's online mirror descent: a squared loss on sequence log-ratios (Kimi Team, arXiv 2501.12599)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.contracts import PluginConfig
from alignflow.core.rl.algorithm import PolicyBatch, RLAlgorithm, Rollout, broadcast
from alignflow.core.rl.parts import group_normalize


class KimiConfig(PluginConfig):
    # The report gives no value. tau is the KL weight of each mirror-descent step: the loss is 0 where
    # log pi/pi_old = (r - r_bar) / tau, so with 0/1 rewards tau = 1 lets a sequence's log-likelihood move by
    # at most one nat per iteration; and r_bar stands in for tau log Z, which it matches as tau grows
    # (at accuracy 1/2: tau log Z = 0.62 for tau = 1 against r_bar = 0.5; 0.93 for tau = 0.1).
    tau: float = Field(1.0, gt=0.0, description="KL weight of each mirror-descent step (not given by the report)")


class Kimi(RLAlgorithm):
    """Kimi k1.5 (arXiv 2501.12599, section 2.3.2): online policy mirror descent with a squared surrogate.

    Per sequence L_i = (r_i - r_bar - tau log(pi_theta(y_i|x) / pi_old(y_i|x)))^2, with r_bar the mean reward
    of the prompt's group (the report's practical choice for tau log Z) and sequence log-likelihoods summed
    over the response tokens; the loss is the mean of L_i over sequences. Its gradient is -2 tau times the
    report's Eq. 3, (1/k) sum_j [grad log pi(y_j) (r_j - r_bar) - (tau/2) grad (log pi(y_j)/pi_old(y_j))^2].
    No clipping, no critic, no reference model: the l2 term keeps pi_theta near pi_old. Each L_i is spread
    evenly over its tokens and reduced by `seq-mean-token-sum`, which gives exactly mean_i L_i for the step.
    An iteration here is one rollout (pi_old = the weights that sampled it, the report's pi_theta_i). The
    report resets the optimizer at each iteration; the rl stage keeps one optimizer for the whole stage,
    so its moments carry across rollouts. For the reset, chain rl stages, one per iteration.
    """

    Config: ClassVar[type[KimiConfig]] = KimiConfig

    @property
    def loss_agg_mode(self) -> str:
        return "seq-mean-token-sum"  # the only mode under which the spread L_i sum to mean_i L_i

    def advantages(self, rollout: Rollout):
        """[B, T] r_i - r_bar (the group's mean reward) on every response token."""
        centred = group_normalize(rollout.rewards, rollout.group, scale=False)
        return broadcast(centred, rollout.response_mask), None

    def loss(self, batch: PolicyBatch):
        mask = batch.response_mask.float()
        lengths = mask.sum(-1).clamp(min=1)
        centred = (batch.advantages * mask).sum(-1) / lengths  # r_i - r_bar, constant over the response
        # No clamp: the log-ratio is never exponentiated, and a squared loss stays finite.
        log_ratio = ((batch.logprobs - batch.old_logprobs) * mask).sum(-1)
        residual = centred - self.config.tau * log_ratio
        per_token = (residual**2 / lengths)[:, None] * mask
        metrics = {
            "kimi/seq_log_ratio": log_ratio.mean(),
            "kimi/seq_log_ratio_abs": log_ratio.abs().mean(),
            "kimi/residual_abs": residual.abs().mean(),
        }
        return per_token, {k: v.detach() for k, v in metrics.items()}


@hookimpl
def register_algorithms(register):
    register("kimi", Kimi)
