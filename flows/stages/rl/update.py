"""The update half of an `rl` step: the forward passes a rollout needs, then mu epochs of optimizer steps.

Every forward runs per micro-batch on ids cut to that micro-batch's longest sequence; outputs are
widened back (zeros) to the rollout's width, where the response mask hides them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import sampler_corrected
from alignflow.core.rl.capabilities import TeacherDistributions, has
from alignflow.core.train.models import token_logprobs
from alignflow.core.rl.parts import LOG_RATIO_CLAMP, advantage_metrics, kl_estimate, masked_mean
from alignflow.flows.stages.rl.distribution import distribution_step
from alignflow.flows.stages.rl.rollout import Batch
from alignflow.flows.stages.rl.shard import Shard

if TYPE_CHECKING:
    from alignflow.flows.stages.rl.stage import Parts


@dataclass(frozen=True)
class Correction:
    """Each token's policy term weighted by k = pi_old / mu, pi_old recomputed on the weights before the update
    (the proximal policy) and mu the sampler's (behaviour) probability: k itself (`decoupled`), min(k, tis_cap),
    or k inside the `icepop` band and 0 outside."""

    tis_cap: float | None = None
    icepop: tuple[float, float] | None = None

    @classmethod
    def of(cls, s) -> "Correction | None":
        """The stage settings' correction, None where the sampler's log-probs are pi_old as they are."""
        return cls(s.tis_cap, s.icepop) if s.decoupled or s.tis_cap is not None or s.icepop is not None else None


@dataclass(frozen=True)
class Knobs:
    """The settings a step's forwards and updates read, fixed for the stage (read once, in `build`)."""

    temperature: float  # of the trainer's log-probs: the sampler's; greedy sampling scores the plain softmax
    packed: bool  # pack_sequences
    micro: int  # micro_batch_size
    epochs: int  # ppo_epochs
    correction: Correction | None

    @classmethod
    def of(cls, s) -> "Knobs":
        temperature = s.generation.temperature if s.generation.temperature > 0 else 1.0
        return cls(temperature, s.pack_sequences, s.micro_batch_size, s.ppo_epochs, Correction.of(s))


@dataclass(frozen=True)
class Targets:
    """A rollout ready for the update: the padded batch, its advantages and returns (None without a critic)."""

    batch: Batch
    advantages: Tensor
    returns: Tensor | None


def chunks(rows: Tensor, size: int) -> list[Tensor]:
    return [c for c in rows.split(size) if len(c)]


def widen(x: Tensor, width: int) -> Tensor:
    """[b, w] -> [b, width], zeros on the right."""
    return F.pad(x, (0, width - x.shape[1]))


def critic_values(critic, ids: Tensor, attention: Tensor, mask: Tensor) -> Tensor:
    """V(s) before each response token: the value head on the previous position (its prefix).

    `critic` is the critic engine's forward (a `ValueModel`): [B, T] values.
    """
    v = critic(ids, attention)
    return F.pad(v[:, :-1], (1, 0)).float() * mask


@torch.no_grad()
def stitched(batch: Batch, micro: int, fn) -> Tensor:
    """fn(ids, attention, mask) -> [b, w] over micro-batches, as one [B, T] tensor.

    On several ranks each computes its share of the micro-batches and all of them get the whole tensor.
    """
    shard = Shard.current()
    out = torch.zeros_like(batch.rollout.response_mask, dtype=torch.float32)
    for rows in shard.mine(chunks(torch.arange(len(out), device=out.device), micro)):
        ids, attention, mask = batch.view(rows)
        out[rows, : ids.shape[1]] = fn(ids, attention, mask).float()
    return shard.sum(out)


def prepare(batch: Batch, micro: int, **fill) -> Batch:
    """The batch with each named Rollout field set to fn(ids, attention, mask) over micro-batches."""
    return replace(batch, rollout=replace(batch.rollout, **{k: stitched(batch, micro, fn) for k, fn in fill.items()}))


def minibatches(group: Tensor, n: int, generator: torch.Generator) -> list[Tensor]:
    """The rollout's rows in `n` minibatches of whole groups, groups in a seeded order."""
    uniq, inverse = torch.unique(group, return_inverse=True)
    order = torch.randperm(len(uniq), generator=generator).to(group.device)
    return [torch.isin(inverse, part).nonzero().flatten() for part in order.tensor_split(n)]


def update(p: "Parts", t: Targets, generator: torch.Generator) -> dict[str, float]:
    """mu epochs over the rollout in `p.n_minibatches` minibatches, one optimizer step each.

    On several ranks each takes its `Shard` of a minibatch's micro-batches; the step's loss is normalised
    over all of them (`step_norm`), so the gradient is the one-process gradient.
    """
    r, k, engine, critic, shard = t.batch.rollout, p.knobs, p.engine, p.critic, Shard.current()
    inert = p.algo.inert_rows(r, t.advantages)
    micro_metrics: dict[str, list[float]] = defaultdict(list)  # one value per micro-batch
    step_metrics: dict[str, list[float]] = defaultdict(list)  # one value per optimizer step, alike on all ranks
    step_losses: list[float] = []  # this rank's share of each step's loss
    entropy = torch.zeros(2, device=r.rewards.device)  # sum over response tokens, token count
    for epoch in range(k.epochs):
        for index, minibatch in enumerate(minibatches(r.group, p.n_minibatches, generator)):
            micro = chunks(minibatch, k.micro)
            norm = engine.step_norm([r.response_mask[m] for m in shard.mine(micro)], p.algo.norm_constant(r))
            micro, weight = trained(micro, minibatch, inert, k.micro)
            step_loss = 0.0
            for rows in shard.mine(micro):
                metrics, ent = micro_step(p, t, rows, norm, weight, measure=epoch == 0 and index == 0)
                if epoch == 0:
                    entropy += ent
                step_loss += float(metrics.pop("actor/loss"))
                for name, v in metrics.items():
                    micro_metrics[name].append(float(v))
            if shard.idle(micro):
                micro_step(p, t, micro[0], norm, 0.0, corrected=False)
            step_losses.append(step_loss)
            for name, v in engine.step().items():
                step_metrics[f"actor/{name}"].append(v)
            for name, v in (critic.step() if critic is not None else {}).items():
                step_metrics[f"critic/{name}"].append(v)
    micro_metrics, step_losses = shard.merge(micro_metrics, step_losses)
    shard.sum(entropy)
    out = {name: sum(v) / len(v) for name, v in {**micro_metrics, **step_metrics, "actor/loss": step_losses}.items()}
    out["actor/entropy"] = (entropy[0] / entropy[1].clamp(min=1)).item()
    out["actor/skipped_rows"] = 0.0 if inert is None else inert.float().mean().item()
    return out


def trained(micro: list[Tensor], minibatch: Tensor, inert: Tensor | None, size: int) -> tuple[list[Tensor], float]:
    """The micro-batches to forward and their loss weight: without the inert rows, which the normaliser still
    counts; all inert: one micro-batch at weight 0, a zero gradient for the optimizer step."""
    if inert is None:
        return micro, 1.0
    live = minibatch[~inert[minibatch]]
    return (chunks(live, size), 1.0) if len(live) else (micro[:1], 0.0)


def micro_step(p: "Parts", t: Targets, rows: Tensor, norm, weight: float = 1.0, measure: bool = False,
               corrected: bool = True) -> tuple[dict[str, Tensor], Tensor]:
    """One forward and backward (of the loss times `weight`): the loss's metrics and the (entropy sum,
    token count) of the rows. The stage's correction (`corrected`) weights each token's policy term
    (`mismatch_weights`), not a KL-to-reference term (`sampler_corrected`). `measure` (the first minibatch, before
    any update) adds the gap between the sampler's log-probs and the trainer's on the sampled tokens. With a
    teacher whose logits the algorithm uses (`TeacherDistributions`), the loss is its `distribution_loss` on both
    models' logits (`distribution_step`)."""
    engine, critic, algo, k = p.engine, p.critic, p.algo, p.knobs
    correction = k.correction if corrected else None
    r, width = t.batch.rollout, t.batch.rollout.response_mask.shape[1]
    ids, attention, mask = t.batch.view(rows)
    weights, counted = None, {}
    if r.sampler_logprobs is not None and correction is not None:
        weights, counted = mismatch_weights(r.old_logprobs[rows], r.sampler_logprobs[rows], r.response_mask[rows],
                                            correction.tis_cap, correction.icepop)
    if p.teacher is not None and has(algo, TeacherDistributions) and algo.uses_teacher_logits:
        with engine.autocast():  # the loss on the logits too: it upcasts them (core/rl/divergence.py)
            per_token, metrics, view, entropy = distribution_step(p, t, rows, (ids, attention, mask), weights)
    else:
        with engine.autocast():
            logprobs, entropy = token_logprobs(engine.model, ids, attention, mask, temperature=k.temperature,
                                               return_entropy=True, packed=k.packed)
            values = widen(critic_values(critic.model, ids, attention, mask), width) if critic is not None else None
        view = r.minibatch(rows, logprobs=widen(logprobs, width), advantages=t.advantages, returns=t.returns,
                           values=values, policy_weights=weights)
        per_token, metrics = sampler_corrected(algo, view)
    metrics.update(counted)
    if measure and r.sampler_logprobs is not None:  # the view's columns (a distribution step cuts them)
        metrics.update(mismatch_metrics(view.logprobs.detach(), view.sampler_logprobs, view.response_mask))
    loss = aggregate(per_token, view.response_mask, algo.loss_agg_mode, norm)
    engine.backward(loss * weight)
    metrics["actor/loss"] = loss.detach()
    if critic is not None:
        value_loss, value_metrics = algo.value_loss(view)
        critic.backward(aggregate(value_loss, view.response_mask, algo.loss_agg_mode, norm) * weight)
        metrics.update(value_metrics)
    return metrics, torch.stack([(entropy.detach() * mask).sum(), mask.sum()])


def mismatch_weights(old_logprobs: Tensor, sampled: Tensor, mask: Tensor, tis_cap: float | None = None,
                     icepop: tuple[float, float] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights (detached) that correct for the sampler: k = pi_old / mu, mu the sampler's probability
    of the token and pi_old the trainer's. Decoupled PPO (neither set): k. Truncated importance sampling (Yao et
    al. 2025): min(k, tis_cap). IcePop: k inside [alpha, beta] (bounds included), 0 outside. With the fraction of
    tokens capped or dropped (decoupled: the mean weight)."""
    k = torch.exp((old_logprobs - sampled).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    if tis_cap is None and icepop is None:
        return k, {"rollout/behaviour_weight_mean": masked_mean(k, mask)}
    if icepop is not None:
        out = (k < icepop[0]) | (k > icepop[1])
        return k.masked_fill(out, 0.0), {"rollout/icepop_masked_frac": masked_mean(out.float(), mask)}
    return k.clamp(max=tis_cap), {"rollout/tis_capped_frac": masked_mean((k > tis_cap).float(), mask)}


def mismatch_metrics(trainer: Tensor, sampler: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's on the same weights:
    mean |difference| and the k3 estimate of KL(sampler || trainer)."""
    return {"rollout/logprob_abs_diff": masked_mean((trainer - sampler).abs(), mask),
            "rollout/kl_sampler_trainer": masked_mean(kl_estimate(sampler, trainer), mask)}


def rollout_stats(rollout, advantages: Tensor) -> dict[str, float]:
    """Advantage statistics and the KL of pi_old to the reference, over response tokens."""
    mask = rollout.response_mask
    out = {k: v.item() for k, v in advantage_metrics(advantages, mask).items()}
    if rollout.ref_logprobs is not None:
        out["actor/kl_ref_k3"] = masked_mean(kl_estimate(rollout.old_logprobs, rollout.ref_logprobs), mask).item()
    return out
