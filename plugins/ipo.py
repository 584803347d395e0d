"""IPO: Identity Preference Optimisation (Azar et al. 2023, arXiv 2310.12036)."""

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.train.offline import PairBatch, PreferenceAlgorithm, per_token


class IPO(PreferenceAlgorithm):
    """Identity Preference Optimisation (Azar et al. 2023): (h - 1/(2 beta))^2 on per-token log-ratios.

    Follows TRL and HALOs: h uses log-ratios averaged over completion tokens (confirmed with the
    authors, per TRL), not the paper's sums; beta plays the paper's tau.
    """

    class Config(PluginConfig):
        beta: float = Field(0.1, gt=0.0)  # tau; TRL and HALOs default

    requires_reference = True

    def pair_losses(self, batch: PairBatch):
        beta = self.config.beta
        chosen = per_token(batch.policy_chosen_logps - batch.ref_chosen_logps, batch.chosen_lengths)
        rejected = per_token(batch.policy_rejected_logps - batch.ref_rejected_logps, batch.rejected_lengths)
        losses = (chosen - rejected - 1 / (2 * beta)) ** 2
        return losses, beta * chosen.detach(), beta * rejected.detach()


@hookimpl
def register_algorithms(register):
    register("ipo", IPO)
