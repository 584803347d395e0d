"""The offline training contract (sft, reward_model, prm, preference stages): batches, base classes.

A stage scores sequences and passes one batch dataclass per micro-batch to `algorithm.loss(batch, norm)`,
which returns `(loss, metrics)`:

* `loss` is a scalar: this micro-batch's share of the optimizer step's loss, normalised by the counts
  of the *whole step* in `norm` (as in aggregation.py), so summing the micro-batch losses gives exactly
  the loss of one big batch. `norm=None` means the micro-batch is the whole step.
  `norm.num_seqs` counts examples (pairs, labelled completions, or sequences); `norm.num_tokens` counts
  the tokens the algorithm averages over (SFT: completion tokens; an `nll_scope` algorithm: the chosen
  tokens in that scope; a PRM: labelled steps); other algorithms ignore it.
* `metrics` are detached scalars, means over this micro-batch, for logging. A metric with no example
  in the micro-batch (KTO's chosen rewards in an all-undesirable batch) is NaN: average with nanmean.

Sequence log-probs are always *summed* over completion tokens (prompt masked) and come with the
completion token counts: an algorithm that needs per-token averages (IPO, SimPO, ORPO) divides by
the counts itself, so a stage computes one thing for every algorithm and caches reference log-probs once.
An algorithm whose loss is per token (BNF) sets `needs_token_logprobs` and also gets `TokenLogps`:
per-token log-probs of both completions under the policy and the reference, and the policy's entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.contracts import Algorithm

NllScope = Literal["completion", "sequence"]  # completion tokens only, or prompt + completion tokens


@dataclass(frozen=True)
class SequenceLogps:
    """Per-sequence log-probs summed over the scored tokens, and how many tokens were scored."""

    logps: Tensor  # [N]
    lengths: Tensor  # [N]

    @classmethod
    def of(cls, token_logps: Tensor, mask: Tensor) -> "SequenceLogps":
        """Reduce [N, T] per-token log-probs over the tokens where `mask` is 1."""
        mask = mask.bool()
        # where, not multiply: padded positions may hold -inf, and 0 * -inf is NaN.
        return cls(torch.where(mask, token_logps, 0.0).sum(-1), mask.sum(-1))


@dataclass(frozen=True)
class TokenLogps:
    """Per-token terms of one set of completions, for `needs_token_logprobs` algorithms; 0 off `mask`.

    `entropy` is the policy's (None for the reference), detached. It stands in for the full distribution
    where a loss needs sum_v sg(p_v) log p_v: that is -H in value and has zero gradient
    (sum_v p_v grad log p_v = grad sum_v p_v = 0), so no [N, T, V] tensor leaves the stage.
    """

    logps: Tensor  # [N, T] log pi(y_t | x, y_<t) at completion tokens
    mask: Tensor  # [N, T] bool, True on completion tokens
    entropy: Tensor | None = None  # [N, T] H(pi(. | x, y_<t)), no gradient


@dataclass(frozen=True)
class TokenBatch:
    """SFT: per-token log-probs of the labels and the mask of tokens that are trained on."""

    logps: Tensor  # [B, T] log pi(y_t | x, y_<t)
    mask: Tensor  # [B, T] 1 on completion tokens (prompt and padding masked)
    correct: Tensor | None = None  # [B, T] argmax == label, for the token-accuracy metric


@dataclass(frozen=True)
class PairBatch:
    """Pairwise preference: summed completion log-probs of chosen (y_w) and rejected (y_l) completions."""

    policy_chosen_logps: Tensor  # [B]
    policy_rejected_logps: Tensor  # [B]
    chosen_lengths: Tensor  # [B] |y_w|, completion tokens
    rejected_lengths: Tensor  # [B] |y_l|
    ref_chosen_logps: Tensor | None = None  # [B] frozen reference, when `requires_reference`
    ref_rejected_logps: Tensor | None = None
    chosen_nll_logps: Tensor | None = None  # [B] policy log-probs of y_w summed over `nll_scope` tokens
    chosen_nll_tokens: Tensor | None = None  # [B] tokens in `nll_scope`
    # with `needs_token_logprobs`: per-token terms (chosen and rejected are padded to their own widths)
    chosen_tokens: TokenLogps | None = None  # policy, with entropy
    rejected_tokens: TokenLogps | None = None
    ref_chosen_tokens: TokenLogps | None = None  # reference, when `requires_reference`
    ref_rejected_tokens: TokenLogps | None = None


@dataclass(frozen=True)
class ListBatch:
    """Listwise preference: summed completion log-probs of the m completions of each prompt, best first."""

    policy_logps: Tensor  # [B, m]
    lengths: Tensor  # [B, m] completion tokens
    ref_logps: Tensor | None = None  # [B, m] frozen reference, when `requires_reference`
    scores: Tensor | None = None  # [B, m] the rows' scores (non-increasing) when the dataset gives them


@dataclass(frozen=True)
class UnpairedBatch:
    """Unpaired binary feedback (KTO): one completion per example, labelled desirable or not."""

    policy_logps: Tensor  # [B] summed completion log-probs
    lengths: Tensor  # [B]
    labels: Tensor  # [B] bool, True = desirable
    ref_logps: Tensor | None = None  # [B], when `requires_reference`
    policy_kl_logps: Tensor | None = None  # [B] mismatched pairs (see `mismatched_pairs`), no gradient
    ref_kl_logps: Tensor | None = None  # [B], when `needs_kl_pairs`


@dataclass(frozen=True)
class RewardBatch:
    """Reward-model training: scalar scores of chosen and rejected sequences."""

    chosen_scores: Tensor  # [B]
    rejected_scores: Tensor  # [B]
    margin: Tensor | None = None  # [B] from the dataset's `margin` column when it has one


@dataclass(frozen=True)
class StepBatch:
    """Process reward model training: a logit and a label at each step's last token, step-major."""

    scores: Tensor  # [B, S] step logits, S = the most steps of a solution in the micro-batch
    labels: Tensor  # [B, S] in [0, 1]: 1 a correct step, 0 a wrong one, or a soft (Monte Carlo) estimate
    mask: Tensor  # [B, S] 1 on real steps, 0 on padding


class Mean(NamedTuple):
    """A metric that is a mean over `count` of the micro-batch's examples, not over all of them.

    A step's value is then the mean over those examples of every micro-batch, whatever the grouping.
    """

    value: Tensor
    count: float


class OfflineAlgorithm(Algorithm):
    """An algorithm trained from a fixed dataset: `loss(batch, norm) -> (step-share loss, metrics)`.

    A metric is a micro-batch mean over its examples, or a `Mean` over some of them.
    """

    batch_type: ClassVar[type]  # the batch dataclass `loss` takes
    needs_kl_pairs: ClassVar[bool] = False  # log-probs of mismatched prompt/completion pairs (KTO)
    # the loss itself all-reduces over ranks (KTO's reference point), so every rank must run the same
    # micro-batches: the ranks do not share out the held-out rows
    loss_reduces_over_ranks: ClassVar[bool] = False
    nll_scope: NllScope | None = None  # which chosen tokens an added NLL term covers; None: no NLL term
    # per-token log-probs and policy entropy in the batch as `TokenLogps` (pairs only), besides the sums
    needs_token_logprobs: ClassVar[bool] = False

    def loss(self, batch, norm: StepNorm | None = None) -> tuple[Tensor, dict[str, Tensor | Mean]]:
        raise NotImplementedError

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        """The step's metrics from the means over its micro-batches: metrics that are not means go here."""
        return means


class PreferenceAlgorithm(OfflineAlgorithm):
    """A pairwise preference loss: subclasses give per-pair losses and implicit rewards."""

    stage: ClassVar[str] = "preference"
    requires_pairs: ClassVar[bool] = True
    batch_type: ClassVar[type] = PairBatch
    # also trains on ranked lists (`ranked` rows: a `ListBatch`, whose rewards/rejected is the best of the rest)
    accepts_lists: ClassVar[bool] = False

    def pair_losses(self, batch: PairBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Per-pair losses [B] and the chosen and rejected rewards [B] (the algorithm's implicit reward)."""
        raise NotImplementedError

    def ranked_losses(self, batch: ListBatch) -> tuple[Tensor, Tensor]:
        """With `accepts_lists`: per-list losses [B] and each completion's implicit reward [B, m]."""
        raise NotImplementedError(f"{type(self).__name__} trains on pairs, not ranked lists")

    def loss(self, batch: PairBatch | ListBatch, norm: StepNorm | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        if isinstance(batch, ListBatch):  # the best against the rest: with m = 2, the pair metrics
            losses, rewards = self.ranked_losses(batch)
            chosen, rejected = rewards[:, 0], rewards[:, 1:].max(-1).values
        else:
            losses, chosen, rejected = self.pair_losses(batch)
        metrics = {"loss": losses.detach().mean(), **reward_metrics(chosen, rejected)}
        return example_mean(losses, norm), metrics


def example_mean(losses: Tensor, norm: StepNorm | None = None) -> Tensor:
    """This micro-batch's share of the mean over the step's examples."""
    count = norm.num_seqs if norm is not None else losses.shape[0]
    return losses.sum() / max(count, 1.0)


def per_token(logps: Tensor, lengths: Tensor) -> Tensor:
    """Summed log-probs averaged over their tokens (an empty completion counts as one token)."""
    return logps / lengths.clamp(min=1).to(logps.dtype)


@torch.no_grad()
def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies over the micro-batch."""
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
    }


def mismatched_pairs(n: int) -> Tensor:
    """For KTO's KL estimate: the completion paired with each prompt i of a micro-batch, (i + 1) mod n.

    As in HALOs; with n = 1 a prompt is paired with its own completion.
    """
    return (torch.arange(n) + 1) % n


class Scorer(Protocol):
    """One micro-batch's log-probs of named sets of sequences: "chosen", "rejected" (pairs), "completion",
    "kl" (unpaired; "kl" = prompt i + completion mismatched_pairs(n)[i]).

    A stage runs the model once per set and sums under the asked scope, or looks up cached reference
    log-probs ("kl" pairs change with the micro-batch: compute them).
    """

    def __call__(self, name: str, scope: NllScope) -> SequenceLogps:
        """Log-probs summed over the set's tokens in `scope`."""

    def tokens(self, name: str) -> TokenLogps:
        """Per-token completion log-probs (and the policy's entropy): asked only by `needs_token_logprobs`."""


def build_batch(
    algo: OfflineAlgorithm, policy: Scorer, reference: Scorer | None = None, labels: Tensor | None = None,
    candidates: list[str] | None = None, scores: Tensor | None = None,
) -> PairBatch | UnpairedBatch | ListBatch:
    """Build a preference algorithm's batch from its flags alone; from ranked lists, the sequence sets
    `candidates` (best first) and the rows' `scores`."""
    if algo.requires_reference and reference is None:
        raise ValueError(f"{type(algo).__name__} requires reference log-probs, but no reference scorer was given")
    ref = reference if algo.requires_reference else None
    if candidates is not None:
        if not getattr(algo, "accepts_lists", False):
            raise ValueError(f"{type(algo).__name__} trains on pairs, not ranked lists")
        sets = [policy(name, "completion") for name in candidates]
        refs = [ref(name, "completion").logps for name in candidates] if ref is not None else None
        scores = scores.to(sets[0].logps.device, sets[0].logps.dtype) if scores is not None else None
        return ListBatch(torch.stack([x.logps for x in sets], -1), torch.stack([x.lengths for x in sets], -1),
                         torch.stack(refs, -1) if refs is not None else None, scores)
    if algo.requires_labels:
        if algo.needs_token_logprobs:
            raise ValueError(f"{type(algo).__name__}: per-token log-probs are built for pairs only")
        if labels is None:
            raise ValueError(f"{type(algo).__name__} requires a desirable/undesirable label per example")
        return _unpaired_batch(algo, policy, ref, labels)
    return _pair_batch(algo, policy, ref)


def _pair_batch(algo: OfflineAlgorithm, policy: Scorer, ref: Scorer | None) -> PairBatch:
    chosen, rejected = policy("chosen", "completion"), policy("rejected", "completion")
    nll = policy("chosen", algo.nll_scope) if algo.nll_scope is not None else None
    ref_chosen = ref("chosen", "completion") if ref is not None else None
    ref_rejected = ref("rejected", "completion") if ref is not None else None
    tokens = algo.needs_token_logprobs
    ref_tokens = tokens and ref is not None
    return PairBatch(
        chosen.logps, rejected.logps, chosen.lengths, rejected.lengths,
        ref_chosen.logps if ref_chosen is not None else None,
        ref_rejected.logps if ref_rejected is not None else None,
        nll.logps if nll is not None else None,
        nll.lengths if nll is not None else None,
        policy.tokens("chosen") if tokens else None,
        policy.tokens("rejected") if tokens else None,
        ref.tokens("chosen") if ref_tokens else None,
        ref.tokens("rejected") if ref_tokens else None,
    )


def _unpaired_batch(algo: OfflineAlgorithm, policy: Scorer, ref: Scorer | None, labels: Tensor) -> UnpairedBatch:
    seqs = policy("completion", "completion")
    policy_kl = ref_kl = None
    if algo.needs_kl_pairs:
        with torch.no_grad():  # the reference point is a constant of the loss
            policy_kl = policy("kl", "completion").logps
        ref_kl = ref("kl", "completion").logps if ref is not None else None
    ref_logps = ref("completion", "completion").logps if ref is not None else None
    labels = labels.bool().to(seqs.logps.device)  # collated on the CPU, scored on the model's device
    return UnpairedBatch(seqs.logps, seqs.lengths, labels, ref_logps, policy_kl, ref_kl)
