"""The RL contract: what the `rl` stage hands an algorithm, and what it gets back.

The stage drives every algorithm the same way, without knowing which one it runs:

    # generate G per prompt, score; old/ref log-probs, values
    rollout = Rollout(...)
    # e.g. DAPO's filter of equal-reward groups
    rollout = rollout.select(algo.filter_groups(rollout))
    # once per rollout, on the whole batch
    advantages, returns = algo.advantages(rollout)
    # rows with a zero loss and gradient: never forwarded
    skip = algo.inert_rows(rollout, advantages)
    for each of ppo_epochs, each optimizer step, each micro-batch `idx`:
        # policy_weights: tis_cap / icepop, pi_old / mu, capped or banded
        batch = rollout.minibatch(idx, logprobs=..., advantages=advantages,
                                  returns=returns, values=..., policy_weights=...)
        # algo.loss, the weights on its policy term only
        per_token, metrics = sampler_corrected(algo, batch)
        norm = StepNorm(step tokens, step sequences, algo.norm_constant(rollout))
        loss = aggregate(per_token, batch.response_mask, algo.loss_agg_mode, norm)
        if algo.requires_critic:  # same mode and norm
            loss += aggregate(algo.value_loss(batch)[0], ...)
    log algo.step_metrics()

The flags (`needs_old_logprobs`, `requires_reference`/`critic`/`teacher`/`step_rewards`/`whole_groups`) say
which forward passes and inputs the stage prepares. What one algorithm alone needs is an opt-in capability
of `alignflow.core.rl.capabilities` that the stage checks with `has(algo, Capability)`: guided samples
(`GuidedSamples`), replayed groups (`Replay`), refill rounds (`Regenerate`), a cost reward
(`CostConstrained`), checkpointed state (`Stateful`), parameters of its own (`ExtraParameters`), each
reward's values apart (`RewardComponents`) and episodes turn by turn (`EpisodeTurns`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core.rl.aggregation import AggMode
from alignflow.core.contracts import Algorithm, PluginConfig
from alignflow.core.rl.capabilities import LegacyMembers, cost_reward_problem  # noqa: F401 (re-exported)
from alignflow.core.rl.parts import (
    KL_CLAMP,
    LOG_RATIO_CLAMP,
    clamp_log_ratio,
    clipped_surrogate,
    group_ids,
    group_sum,
    kl_estimate,
    masked_mean,
)


@dataclass
class Rollout:
    """One rollout batch after generation and scoring: B responses (G per prompt), T response positions."""

    rewards: Tensor  # [B] weighted total reward
    group: Tensor  # [B] long, prompt index
    response_mask: Tensor  # [B, T] 1 on generated tokens
    old_logprobs: Tensor  # [B, T] log-probs of the policy that generated the batch
    max_new_tokens: int  # generation budget (Dr. GRPO's normaliser)
    correct: Tensor | None = None  # [B] accuracy in {0, 1}: what DAPO filters on and DisCO classifies
    ref_logprobs: Tensor | None = None  # [B, T] frozen reference, when requires_reference
    teacher_logprobs: Tensor | None = None  # [B, T] frozen teacher on the sampled tokens, when requires_teacher
    values: Tensor | None = None  # [B, T] critic values before each token, when requires_critic
    truncated: Tensor | None = None  # [B] bool: hit max_new_tokens without EOS
    # process supervision (requires_step_rewards): a reward at each reasoning step's last token
    step_rewards: Tensor | None = None  # [B, T] the step's reward at its last token, 0 elsewhere
    step_mask: Tensor | None = None  # [B, T] 1 at each step's last token
    # [B, T] the sampler's own log-probs (the behaviour policy mu), kept beside a recomputed pi_old
    sampler_logprobs: Tensor | None = None
    # [B] bool: sampled after `guided_prompt` (the prompt with the reference answer) but scored, as every
    # log-prob here, after the plain prompt; None when the algorithm asks for no guided samples
    guided: Tensor | None = None
    # [B] the raw values of the reward the algorithm names as `cost_reward`, NaN where it failed (None)
    costs: Tensor | None = None
    # [B, K] each stage reward's raw values, NaN where it returned None, for `RewardComponents` algorithms
    reward_values: Tensor | None = None
    reward_weights: tuple[float, ...] | None = None  # the K rewards' weights in the stage, same order
    # multi-turn episodes, for `EpisodeTurns` algorithms: each model token's turn in its episode (0, 1, ...) and
    # a hash of the state that turn started from; -1 and 0 on every other position
    turns: Tensor | None = None  # [B, T] long
    states: Tensor | None = None  # [B, T] long

    def __post_init__(self):
        b, t = self.response_mask.shape
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.shape[0] != b:
                raise ValueError(f"Rollout.{f.name} has {value.shape[0]} rows, response_mask has {b}")
            if isinstance(value, Tensor) and value.dim() == 2 and value.shape[1] != t and f.name != "reward_values":
                raise ValueError(f"Rollout.{f.name} has {value.shape[1]} positions, response_mask has {t}")

    @property
    def lengths(self) -> Tensor:
        """[B] response lengths in tokens."""
        return self.response_mask.sum(-1)

    def select(self, index: Tensor) -> "Rollout":
        """The rows picked by a boolean mask or an index tensor."""
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self) if _is_rows(self, f.name)})

    @staticmethod
    def cat(rollouts: list["Rollout"]) -> "Rollout":
        """Rollouts of several generation rounds as one; group ids are offset so rounds never share a group."""
        offset, groups = 0, []
        for r in rollouts:
            groups.append(r.group + offset)
            offset += int(r.group.max()) + 1 if r.group.numel() else 0
        first = rollouts[0]
        joined = {
            f.name: torch.cat([getattr(r, f.name) for r in rollouts])
            for f in fields(first)
            if _is_rows(first, f.name) and f.name != "group"
        }
        return replace(first, group=torch.cat(groups), **joined)

    def minibatch(
        self,
        index: Tensor,
        *,
        logprobs: Tensor,
        advantages: Tensor,
        returns: Tensor | None = None,
        values: Tensor | None = None,
        policy_weights: Tensor | None = None,
    ) -> "PolicyBatch":
        """The loss's view of rows `index`: current `logprobs`/`values` and `policy_weights` of those rows;
        rollout-wide `advantages`/`returns` are sliced here."""
        rows = self.select(index)
        return PolicyBatch(logprobs=logprobs, old_logprobs=rows.old_logprobs, advantages=advantages[index],
                           response_mask=rows.response_mask, group=rows.group, correct=rows.correct,
                           guided=rows.guided, ref_logprobs=rows.ref_logprobs, teacher_logprobs=rows.teacher_logprobs,
                           sampler_logprobs=rows.sampler_logprobs, values=values, old_values=rows.values,
                           returns=None if returns is None else returns[index], policy_weights=policy_weights)


def _is_rows(rollout: Rollout, name: str) -> bool:
    return isinstance(getattr(rollout, name), Tensor)


@dataclass
class PolicyBatch:
    """A micro-batch as the loss sees it: b rows, T positions."""

    logprobs: Tensor  # [b, T] current policy, differentiable
    old_logprobs: Tensor  # [b, T]
    advantages: Tensor  # [b, T]
    response_mask: Tensor  # [b, T]
    group: Tensor  # [b]
    correct: Tensor | None = None  # [b]
    guided: Tensor | None = None  # [b] bool, see Rollout.guided
    ref_logprobs: Tensor | None = None  # [b, T]
    teacher_logprobs: Tensor | None = None  # [b, T]
    sampler_logprobs: Tensor | None = None  # [b, T] the behaviour policy mu, see Rollout.sampler_logprobs
    values: Tensor | None = None  # [b, T] current critic, differentiable
    old_values: Tensor | None = None  # [b, T] critic at rollout time
    returns: Tensor | None = None  # [b, T] critic targets
    # [b, T] detached weights of the policy term alone, the stage's correction for the sampler (`tis_cap`,
    # `icepop`: pi_old / mu, capped or banded); None: 1. A KL-to-reference term is never weighted (`with_kl_loss`)
    policy_weights: Tensor | None = None


class RLAlgorithm(LegacyMembers, Algorithm):
    """Base of online RL algorithms; the class flags describe the default config, an instance refines them.

    What only some algorithms need is an opt-in capability (`alignflow.core.rl.capabilities`); the members
    inherited from `LegacyMembers` are deprecated aliases of those, kept for one release."""

    stage: ClassVar[str] = "rl"  # the stage kind RL algorithms serve
    needs_old_logprobs: ClassVar[bool] = True  # importance ratios / KL to pi_old
    requires_step_rewards: ClassVar[bool] = False  # a process reward (the `prm` reward) scores each step
    requires_whole_groups: ClassVar[bool] = False  # the loss couples responses of one prompt
    requires_teacher: ClassVar[bool] = False  # a frozen teacher (the stage's `teacher` input) scores the samples
    # the loss multiplies its policy term by `PolicyBatch.policy_weights` itself and adds its KL-to-reference term
    # unweighted (`with_kl_loss` does both); False: the loss never sees them, and the stage multiplies its whole
    # per-token loss by them (`sampler_corrected`)
    applies_policy_weights: ClassVar[bool] = False

    def __init__(self, config: PluginConfig | None = None):
        super().__init__(config)
        self.requires_reference = self.uses_reference()

    def uses_reference(self) -> bool:
        """Whether this config needs reference log-probs (a KL term with a positive coefficient)."""
        return type(self).requires_reference

    @property
    def loss_agg_mode(self) -> str:
        return getattr(self.config, "loss_agg_mode", "token-mean")

    def norm_constant(self, rollout: Rollout) -> float | None:
        """StepNorm.constant for `seq-mean-token-sum-norm`; None when the mode needs none.

        Kept on the base, not a capability: `seq-mean-token-sum-norm` is one of the shared aggregation modes
        any algorithm's config may pick, and the stage passes this constant to every aggregation; only its
        value is the algorithm's (Dr. GRPO: the generation budget, read from the rollout)."""
        return None

    def filter_groups(self, rollout: Rollout) -> Tensor:
        """[B] bool: the responses to train on (DAPO drops groups of equal rewards). Default keeps all."""
        return torch.ones_like(rollout.rewards, dtype=torch.bool)

    def advantages(self, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
        """[B, T] advantages and [B, T] critic returns (None without a critic), on the whole rollout."""
        raise NotImplementedError

    def inert_rows(self, rollout: Rollout, advantages: Tensor) -> Tensor | None:
        """[B] bool: rows whose per-token loss is exactly 0 with a zero gradient, which the stage then does not
        forward or backward at all (they still count in the step's normaliser, so the gradient is unchanged).
        None (default): every row is trained."""
        return None

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """[b, T] per-token loss to minimise (the stage aggregates it) and detached scalar metrics."""
        raise NotImplementedError

    def value_loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """[b, T] per-token critic loss, already weighted, for `requires_critic` algorithms."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def step_metrics(self) -> dict[str, float]:
        """Scalars the last `advantages` call measured (RePO's multiplier, SGPO's group counts); the stage logs
        them with the step's metrics. Default: none."""
        return {}


class KLLossConfig(PluginConfig):
    """The KL-to-reference loss term and the clamps on log-ratios and KL estimates that the policy losses share.

    `kl_loss_bias_correction` weights each token's KL estimate by the importance ratio r = pi_theta / pi_old,
    differentiable and unclipped (TRL's `use_bias_correction_kl`, DeepSeek-V3.2): the samples come from pi_old,
    and E_{pi_old}[r k3] = KL(pi_theta || pi_ref), whose gradient is grad r k3 = r (log pi_theta - log pi_ref)
    grad log pi_theta, the reverse KL's. Unweighted, the gradient of k3 is (1 - pi_ref / pi_theta)
    grad log pi_theta, whose expectation is the gradient of the forward KL(pi_ref || pi_theta). The weight
    changes the gradient even on-policy (r = 1 in value, grad log pi_theta in gradient). Default False: the
    DeepSeekMath formula that `grpo` and its variants follow, and verl's and OpenRLHF's default, so configs with
    a KL term keep their gradient; TRL 1.16 defaults it to True (with beta 0, so it is inert there).
    """

    kl_loss_coef: float = Field(0.0, ge=0.0)  # beta of a KL-to-reference term in the loss
    # Schulman's k1 = -log r, k2 = (log r)^2 / 2 or k3 = r - 1 - log r, r = pi_ref / pi_theta
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_loss_bias_correction: bool = False  # r x KL estimate per token, as TRL 1.16's default; see the docstring
    # |log r| and |log pi_ref / pi_theta| clamped before exp(), zero gradient past it (verl); None: no clamp (TRL)
    log_ratio_clamp: float | None = Field(LOG_RATIO_CLAMP, gt=0.0)
    # each per-token KL estimate clamped to +-kl_clamp (OpenRLHF; verl for k3); k3 reaches 10 at log rho = 2.61.
    # None: no clamp (TRL)
    kl_clamp: float | None = Field(KL_CLAMP, gt=0.0)


class PolicyGradientConfig(KLLossConfig):
    """What every clipped policy-gradient variant shares."""

    clip_low: float = Field(0.2, ge=0.0, lt=1.0)  # epsilon_low
    clip_high: float = Field(0.2, ge=0.0)  # epsilon_high
    dual_clip: float | None = Field(None, gt=1.0)  # c of dual-clip PPO; None disables
    loss_agg_mode: AggMode = "token-mean"  # how per-token losses become the step's loss (core/rl/aggregation.py)


class PolicyGradient(RLAlgorithm):
    """PPO's clipped surrogate plus an optional KL-to-reference loss; subclasses supply the advantages."""

    # clip ranges, the KL term and its clamps, the aggregation mode
    Config: ClassVar[type[PluginConfig]] = PolicyGradientConfig
    applies_policy_weights: ClassVar[bool] = True  # in `with_kl_loss`, which every policy loss here ends with

    def uses_reference(self) -> bool:
        return self.config.kl_loss_coef > 0

    def inert_rows(self, rollout: Rollout, advantages: Tensor) -> Tensor | None:
        """The rows of groups whose every advantage is 0 (e.g. GRPO groups that all pass or all fail): the
        surrogate is advantage x ratio, so their loss and gradient are 0 unless a KL term or a critic reads
        them. Whole groups only, so a loss that couples a group's rows (λ-GRPO's weights) sees all or none."""
        if self.config.kl_loss_coef > 0 or self.requires_critic:
            return None
        live = ((advantages != 0) & rollout.response_mask.bool()).any(-1)
        inverse, n = group_ids(rollout.group)
        return group_sum(live.long(), inverse, n)[inverse] == 0

    def surrogate_weights(self, batch: PolicyBatch) -> Tensor | None:
        """[b] per-response weights on the surrogate (λ-GRPO); None for uniform."""
        return None

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        c, mask = self.config, batch.response_mask
        loss, ratio, flags = clipped_surrogate(
            batch.logprobs, batch.old_logprobs, batch.advantages, c.clip_low, c.clip_high, c.dual_clip,
            c.log_ratio_clamp,
        )
        weights = self.surrogate_weights(batch)
        if weights is not None:
            loss = loss * weights[:, None]
        metrics = {f"actor/{name}_frac": masked_mean(flag.float(), mask) for name, flag in flags.items()}
        metrics["actor/ratio_mean"] = masked_mean(ratio, mask)
        return with_kl_loss(loss, batch, c, metrics)


def with_kl_loss(loss: Tensor, batch: PolicyBatch, config: KLLossConfig, metrics: dict[str, Tensor],
                 ratio: Tensor | None = None):
    """`loss` (the policy term) times `batch.policy_weights`, + kl_loss_coef * the per-token KL estimate to the
    reference (`actor/kl_ref`) when the coefficient is positive, and the metrics detached: the end of every
    policy loss with an optional KL term.

    The sampler correction weights the policy term only, as verl (which adds the KL loss outside its policy
    losses), TRL (its vLLM importance ratio multiplies the loss before `beta * kl` is added) and IcePop's
    objective. With `kl_loss_bias_correction` the estimate (clamped first) is multiplied by `ratio`, by default
    the token ratio exp(clamp(log pi_theta - log pi_old, +-log_ratio_clamp)), differentiable; an algorithm whose
    ratio is per response (GSPO) passes its own, as TRL uses the sequence ratio there.
    """
    loss = policy_weighted(loss, batch)
    if config.kl_loss_coef > 0:
        bound = config.log_ratio_clamp
        kl = kl_estimate(batch.logprobs, batch.ref_logprobs, config.kl_loss_estimator, config.kl_clamp, bound)
        if config.kl_loss_bias_correction:
            if ratio is None:
                ratio = clamp_log_ratio(batch.logprobs - batch.old_logprobs, bound).exp()
            kl = kl * ratio
        loss = loss + config.kl_loss_coef * kl
        metrics["actor/kl_ref"] = masked_mean(kl, batch.response_mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


def policy_weighted(loss: Tensor, batch: PolicyBatch) -> Tensor:
    """[b, T] `loss` times `batch.policy_weights` (the sampler correction); unchanged without them."""
    return loss if batch.policy_weights is None else loss * batch.policy_weights


def sampler_corrected(algo: RLAlgorithm, batch: PolicyBatch, loss=None) -> tuple[Tensor, dict[str, Tensor]]:
    """`loss(batch)` (default `algo.loss`) with `batch.policy_weights`: applied by the loss to its policy term when
    the algorithm `applies_policy_weights`, else (the loss never sees them) to its whole per-token loss."""
    loss = loss or algo.loss
    if algo.applies_policy_weights or batch.policy_weights is None:
        return loss(batch)
    per_token, metrics = loss(replace(batch, policy_weights=None))
    return per_token * batch.policy_weights, metrics


def broadcast(per_response: Tensor, mask: Tensor) -> Tensor:
    """A [B] per-response value on every response token: [B, T]."""
    return per_response[:, None] * mask.to(per_response.dtype)
