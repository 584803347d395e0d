"""KTO: Model Alignment as Prospect Theoretic Optimization (Ethayarajh et al. 2024, arXiv 2402.01306)."""

import torch
import torch.distributed as dist
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import Mean, OfflineAlgorithm, UnpairedBatch, example_mean


def reference_point(kl_logratios: torch.Tensor) -> torch.Tensor:
    """z_ref = max(0, mean of the mismatched pairs' log-ratios), over all ranks, without gradient."""
    total = torch.stack([kl_logratios.detach().sum(), kl_logratios.new_tensor(float(kl_logratios.numel()))])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # HALOs: across processes
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1.0)).clamp(min=0.0)


class KTO(OfflineAlgorithm):
    """KTO (Ethayarajh et al. 2024): prospect-theoretic loss on unpaired desirable/undesirable completions.

    As HALOs and TRL: r = summed log-ratio to the reference; z_ref from mismatched pairs of the micro-batch.
    """

    class Config(PluginConfig):
        beta: float = Field(0.1, gt=0.0)  # HALOs and TRL default
        desirable_weight: float = Field(1.0, gt=0.0)  # lambda_D
        undesirable_weight: float = Field(1.0, gt=0.0)  # lambda_U; keep lambda_D n_D / (lambda_U n_U) in [1, 4/3]

    stage = "preference"
    requires_reference = True
    requires_labels = True
    needs_kl_pairs = True
    loss_reduces_over_ranks = True  # `reference_point`
    batch_type = UnpairedBatch

    def loss(self, batch: UnpairedBatch, norm: StepNorm | None = None):
        beta, desirable = self.config.beta, batch.labels.bool()
        z_ref = reference_point(batch.policy_kl_logps - batch.ref_kl_logps).to(batch.policy_logps.dtype)
        logratios = batch.policy_logps - batch.ref_logps
        losses = torch.where(
            desirable,
            self.config.desirable_weight * (1 - torch.sigmoid(beta * (logratios - z_ref))),
            self.config.undesirable_weight * (1 - torch.sigmoid(beta * (z_ref - logratios))),
        )
        return example_mean(losses, norm), self.metrics(losses, beta * logratios, desirable, beta * z_ref)

    @torch.no_grad()
    def metrics(self, losses, rewards, desirable, beta_z_ref) -> dict[str, torch.Tensor | Mean]:
        """Rewards are beta * log-ratio; an example is "accurate" when it sits on its label's side of z_ref.

        The chosen (rejected) reward is a mean over the desirable (undesirable) examples alone (NaN when
        there are none), so a step's margin is taken between the step's two means (`summarize`).
        """
        chosen, rejected = rewards[desirable].mean(), rewards[~desirable].mean()
        n_desirable = int(desirable.sum())
        return {
            "loss": losses.mean(),
            "rewards/chosen": Mean(chosen, n_desirable),
            "rewards/rejected": Mean(rejected, len(rewards) - n_desirable),
            "rewards/margins": chosen - rejected,
            "rewards/accuracies": ((rewards > beta_z_ref) == desirable).float().mean(),
            "kl": beta_z_ref / self.config.beta,
        }

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        if "rewards/chosen" in means and "rewards/rejected" in means:
            return {**means, "rewards/margins": means["rewards/chosen"] - means["rewards/rejected"]}
        return means


@hookimpl
def register_algorithms(register):
    register("kto", KTO)
