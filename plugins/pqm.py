"""PQM: a process reward model as a Q-value ranking (Li and Li 2025, arXiv 2410.11287, Eq. 10)."""

import torch
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import OfflineAlgorithm, StepBatch, example_mean


class PQM(OfflineAlgorithm):
    """Plackett-Luce ranking of step Q-values: wrong steps + zeta < Q_0 = 0 < correct steps, later higher.

    Per solution, with C its correct steps and W its wrong ones (label > 0.5 is correct):
    for each t in C, -log[e^{Q_t} / (e^{Q_t} + sum_{j in C, j<t} e^{Q_j} + e^{Q_0} + sum_{w in W} e^{Q_w + zeta})],
    and when W is not empty, -log[1 / (1 + sum_{w in W} e^{Q_w + zeta})]; the solution's loss is the mean
    of its terms, the step's loss the mean over solutions. The paper's code sums over j <= t from the
    second correct step on (an off-by-one in its cumulative sum, counting Q_t twice); this follows the
    paper. Scores are read as logits: the `prm` reward's sigmoid ranks them in the same order.
    """

    class Config(PluginConfig):
        zeta: float = Field(4.0, ge=0.0)  # margin that pushes wrong steps below the initial state

    stage = "prm"
    batch_type = StepBatch

    def loss(self, batch: StepBatch, norm: StepNorm | None = None):
        q, mask = batch.scores, batch.mask.bool()
        correct = mask & (batch.labels > 0.5)
        wrong = mask & ~correct
        # A finite "minus infinity": exp() of it is 0, and its gradients are 0, not NaN.
        never = torch.finfo(q.dtype).min / 4
        # log-sum-exp of everything a correct step t outranks: correct steps j < t, Q_0 = 0, wrong + zeta
        below_wrong = torch.where(wrong, q + self.config.zeta, never).logsumexp(-1)  # [B]
        upto = torch.where(correct, q, never).logcumsumexp(-1)  # over j <= t
        earlier = torch.cat([torch.full_like(upto[:, :1], never), upto[:, :-1]], -1)  # over j < t
        zero = torch.zeros_like(below_wrong)
        rest = torch.stack([earlier, zero[:, None].expand_as(q), below_wrong[:, None].expand_as(q)]).logsumexp(0)
        step_terms = torch.logaddexp(q, rest) - q  # -log softmax of Q_t against what it outranks
        initial = torch.logaddexp(zero, below_wrong)  # -log[1 / (1 + sum_w e^{Q_w + zeta})]
        has_wrong = wrong.any(-1)
        totals = torch.where(correct, step_terms, 0.0).sum(-1) + torch.where(has_wrong, initial, 0.0)
        counts = correct.sum(-1) + has_wrong
        losses = totals / counts.clamp(min=1)
        with torch.no_grad():
            steps = mask.sum().clamp(min=1)
            metrics = {
                "loss": losses.mean(),
                "accuracy": (((q > 0) == correct) & mask).sum() / steps,  # Q_0 = 0 is the decision line
                "steps/positive": correct.sum() / steps,
            }
        return example_mean(losses, norm), metrics


@hookimpl
def register_algorithms(register):
    register("pqm", PQM)
