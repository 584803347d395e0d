"""BNF: Bidirectional Negative Feedback (Mao et al., ICLR 2025, arXiv 2410.04834)."""

import torch
from torch import Tensor

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.train.offline import PairBatch, PreferenceAlgorithm, TokenLogps

EPS = 1e-6  # as in the reference code (sail-sg/oat `BNFLoss`, contributed by the paper's first author)


class BNF(PreferenceAlgorithm):
    """BNF: each response token is trained by cross-entropy against a dynamic target Q_t built from pi_ref.

    Per token, with p_t = pi(y_t), p_t^ref = pi_ref(y_t) and sg = stop-gradient:
    w_t = sg(min(p_t / (p_t^ref + 1e-6), 1)), u_t = sg((1 - w_t + 1e-6) / (1 - p_t + 1e-6)),
    E_t = sum_v sg(p_v) log p_v - sg(p_t) log p_t, l_t = w_t log p_t + u_t E_t = sum_v Q_t(v) log pi(v)
    with Q_t(y_t) = w_t and Q_t(v) = (1 - w_t) p_v / (1 - p_t) elsewhere (up to the 1e-6 terms).
    S(y) = sum_t l_t / T_min and loss = -mean(S(y_w) - S(y_l)). As in oat, T_min is the shortest
    completion among the micro-batch's chosen and rejected ones, so it is batch-dependent: a pair's weight
    depends on the micro-batch it lands in (micro_batch_size, data-parallel ranks), not on the pair alone.
    No hyperparameters. The reference is sail-sg/oat `oat/learners/loss.py::BNFLoss` (commit c1a074c).
    """

    class Config(PluginConfig):
        """BNF has no hyperparameters besides the optimizer's: that is the paper's point."""

    requires_reference = True
    needs_token_logprobs = True

    def pair_losses(self, batch: PairBatch) -> tuple[Tensor, Tensor, Tensor]:
        chosen, rejected = batch.chosen_tokens, batch.rejected_tokens
        t_min = torch.minimum(chosen.mask.sum(-1).min(), rejected.mask.sum(-1).min()).clamp(min=1)
        s_chosen = token_objective(chosen, batch.ref_chosen_tokens).sum(-1) / t_min
        s_rejected = token_objective(rejected, batch.ref_rejected_tokens).sum(-1) / t_min
        # rewards for the logs, as oat reports them: summed log-ratios (DPO's implicit reward, beta = 1)
        chosen_reward = (batch.policy_chosen_logps - batch.ref_chosen_logps).detach()
        rejected_reward = (batch.policy_rejected_logps - batch.ref_rejected_logps).detach()
        return -(s_chosen - s_rejected), chosen_reward, rejected_reward


def token_objective(policy: TokenLogps, ref: TokenLogps) -> Tensor:
    """l_t = w_t log p_t + u_t E_t at each completion token [N, T], 0 elsewhere."""
    logp = policy.logps
    p = logp.detach().exp()
    w = torch.clamp(p / (ref.logps.exp() + EPS), max=1.0)
    u = (1 - w + EPS) / (1 - p + EPS)
    # sum_v sg(p_v) log p_v is -H_t in value and has zero gradient (sum_v p_v grad log p_v = grad sum_v p_v
    # = 0), so the detached entropy gives E_t exactly, without the [N, T, V] log-softmax oat keeps.
    other = -policy.entropy.detach() - p * logp
    return torch.where(policy.mask, w * logp + u * other, 0.0)


@hookimpl
def register_algorithms(register):
    register("bnf", BNF)
