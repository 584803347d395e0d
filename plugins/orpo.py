"""ORPO: Monolithic Preference Optimization without Reference Model (Hong et al. 2024, arXiv 2403.07691)."""

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import PairBatch, PreferenceAlgorithm, per_token

# p = 1 exactly (fp32 log-softmax can round every token's log-prob to 0) would make the odds infinite.
MAX_MEAN_LOGP = -1e-10


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(mean token log-prob), in float64 as the official code does."""
    x = mean_logps.double().clamp(max=MAX_MEAN_LOGP)
    return x - log1mexp(x)


class ORPO(PreferenceAlgorithm):
    """ORPO (Hong et al. 2024): NLL(y_w) + lambda * -log sigma(log odds(y_w) - log odds(y_l)), no reference.

    odds use p = exp(mean token log-prob). The NLL is a token mean over the step's chosen sequences and,
    as in the official code by default and in TRL 1.16, includes prompt tokens (`nll_includes_prompt: false`
    is the official scripts' --disable_prompt_loss).
    """

    class Config(PluginConfig):
        alpha: float = Field(0.1, ge=0.0)  # the paper's lambda: official scripts' --alpha, TRL's beta
        nll_includes_prompt: bool = True  # official default; False = --disable_prompt_loss

    @property
    def nll_scope(self):
        return "sequence" if self.config.nll_includes_prompt else "completion"

    def log_odds_ratio(self, batch: PairBatch) -> torch.Tensor:
        """log(odds(y_w) / odds(y_l)) per pair, float64."""
        chosen = per_token(batch.policy_chosen_logps, batch.chosen_lengths)
        rejected = per_token(batch.policy_rejected_logps, batch.rejected_lengths)
        return log_odds(chosen) - log_odds(rejected)

    def pair_losses(self, batch: PairBatch):
        alpha, dtype = self.config.alpha, batch.policy_chosen_logps.dtype
        losses = -alpha * F.logsigmoid(self.log_odds_ratio(batch)).to(dtype)
        # TRL's reward analog: lambda * mean token log-prob.
        chosen = alpha * per_token(batch.policy_chosen_logps, batch.chosen_lengths)
        rejected = alpha * per_token(batch.policy_rejected_logps, batch.rejected_lengths)
        return losses, chosen.detach(), rejected.detach()

    def loss(self, batch: PairBatch, norm: StepNorm | None = None):
        if batch.chosen_nll_logps is None or batch.chosen_nll_tokens is None:
            raise ValueError("ORPO needs PairBatch.chosen_nll_logps and chosen_nll_tokens (see nll_scope)")
        or_loss, metrics = super().loss(batch, norm)
        nll_sum = -batch.chosen_nll_logps.sum()
        tokens = float(batch.chosen_nll_tokens.sum())
        step_tokens = norm.num_tokens if norm is not None else tokens
        with torch.no_grad():
            metrics["log_odds_ratio"] = self.log_odds_ratio(batch).mean().to(nll_sum.dtype)
            metrics["or_loss"] = metrics["loss"]
            metrics["nll_loss"] = nll_sum.detach() / max(tokens, 1.0)
            metrics["loss"] = metrics["or_loss"] + metrics["nll_loss"]
        return nll_sum / max(step_tokens, 1.0) + or_loss, metrics


@hookimpl
def register_algorithms(register):
    register("orpo", ORPO)
