"""LarPO: LLM alignment as retriever preference optimization (Jin et al., ICML 2025, arXiv 2502.03699).

The paper reads the policy as a retriever over responses and the DPO implicit reward
s(y) = beta * log(pi(y|x) / pi_ref(y|x)) as its relevance score, and trains it with IR objectives over a
list of candidates y_1..y_m of one prompt, ordered best first by a reward model's scores psi:

    contrastive  L = -log( exp s(y_1) / sum_j exp s(y_j) )                 y_1 the positive, the rest negatives
    lambdarank   L = -sum_{psi_i > psi_j} lambda_ij log sigma(s(y_i) - s(y_j)),
                 lambda_ij = |G_i - G_j| * |1/D(tau_i) - 1/D(tau_j)|, G = 2^psi - 1, D(tau) = log2(1 + tau)
    listmle      L = -sum_i log( exp s(y_i) / sum_{j >= i} exp s(y_j) )  (Plackett-Luce)

With two candidates the contrastive and ListMLE forms are DPO's loss exactly; LambdaRank is DPO's loss times
lambda_12 = 1 - 1/log2(3) for labels psi = (1, 0).

No code was released with the paper, so these forms are a reconstruction from its text and from LiPO
(Liu et al. 2024, arXiv 2402.01878, which shares an author) for the LambdaRank weights. Not verified against
the paper's own equations: the exact lambda_ij (here tau_i is y_i's 1-based rank under the current s,
detached, as in LiPO's lambda loss), beta (here DPO's 0.1), whether s is length-normalised
(`length_normalize`, off by default), and which form the paper's headline results use. Without RM scores a
list of m candidates gets psi = m-1, ..., 0 (its rank order). The paper's hard-negative mining, candidate
lists built from the policy's samples and merged across iterations, and its iterative loop
(its Algorithm 1) are pipeline matters, not part of this loss.

The `preference` stage feeds it pairs (lists of two, chosen first) or ranked lists: `ranked` rows
{prompt, completions (best first), scores}, which a `rejection_sampling` stage writes from the policy's own
samples with `output: lists` (the best sample and the next `list_size - 1` distinct worse ones: the paper's
hard negatives). The row scores are lambdarank's psi. Scores may tie below the first (a 0/1 verifier's
negatives): the contrastive form needs only the first to be best, lambdarank weighs tied pairs 0, while
ListMLE ranks tied candidates in their list order, an order the data does not give.
"""

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.train.offline import ListBatch, PairBatch, PreferenceAlgorithm, per_token

Form = Literal["contrastive", "lambdarank", "listmle"]


def rank_labels(s: Tensor) -> Tensor:
    """psi = m-1, ..., 0 for lists [B, m] ordered best first."""
    m = s.shape[-1]
    return torch.arange(m - 1, -1, -1, dtype=s.dtype, device=s.device).expand_as(s)


def ranks(s: Tensor) -> Tensor:
    """1-based position of each candidate when its list is sorted by s, highest first (ties: list order)."""
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    positions = torch.arange(1, s.shape[-1] + 1, dtype=s.dtype, device=s.device).expand_as(s)
    return torch.empty_like(s).scatter_(-1, order, positions)


def lambda_weights(s: Tensor, psi: Tensor) -> Tensor:
    """lambda_ij [B, m, m] = |G_i - G_j| * |1/D(tau_i) - 1/D(tau_j)|, tau from the detached scores s."""
    gain = 2.0 ** psi - 1
    discount = 1 / torch.log2(1 + ranks(s.detach()))
    return (gain[:, :, None] - gain[:, None, :]).abs() * (discount[:, :, None] - discount[:, None, :]).abs()


def list_losses(s: Tensor, form: Form, psi: Tensor | None = None) -> Tensor:
    """Per-list losses [B] of scores s [B, m] ordered best first; psi [B, m] relevance labels (lambdarank)."""
    if form == "contrastive":
        return -torch.log_softmax(s, dim=-1)[:, 0]
    if form == "listmle":
        tails = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)  # log sum_{j >= i} exp s_j
        return (tails - s).sum(-1)
    if form != "lambdarank":
        raise ValueError(f"unknown LarPO loss {form!r}: expected contrastive, lambdarank or listmle")
    psi = rank_labels(s) if psi is None else psi.to(s.dtype)
    better = psi[:, :, None] > psi[:, None, :]
    pairs = lambda_weights(s, psi) * F.logsigmoid(s[:, :, None] - s[:, None, :])
    return -torch.where(better, pairs, 0.0).sum((-2, -1))


class LarPO(PreferenceAlgorithm):
    """LarPO (Jin et al. 2025): a contrastive, LambdaRank or ListMLE loss on DPO's implicit rewards."""

    class Config(PluginConfig):
        loss: Form = "contrastive"  # the paper's three objectives; which it reports as LarPO is unverified
        beta: float = Field(0.1, gt=0.0)  # DPO's; the paper's value is unverified
        length_normalize: bool = False  # s averaged over completion tokens (SimPO-style); unverified

    requires_reference = True
    accepts_lists = True

    def scores(self, policy: Tensor, ref: Tensor, lengths: Tensor) -> Tensor:
        """s(y) = beta * log(pi / pi_ref), per completion token with `length_normalize`."""
        ratio = policy - ref
        return self.config.beta * (per_token(ratio, lengths) if self.config.length_normalize else ratio)

    def pair_losses(self, batch: PairBatch):
        chosen = self.scores(batch.policy_chosen_logps, batch.ref_chosen_logps, batch.chosen_lengths)
        rejected = self.scores(batch.policy_rejected_logps, batch.ref_rejected_logps, batch.rejected_lengths)
        losses = list_losses(torch.stack([chosen, rejected], dim=-1), self.config.loss)
        return losses, chosen.detach(), rejected.detach()

    def ranked_losses(self, batch: ListBatch):
        s = self.scores(batch.policy_logps, batch.ref_logps, batch.lengths)  # [B, m]
        return list_losses(s, self.config.loss, batch.scores), s.detach()


@hookimpl
def register_algorithms(register):
    register("larpo", LarPO)
