"""The `rl` stage: online RL with any registered RL algorithm, driven by its flags and capabilities alone.

Per step: groups of earlier steps to replay -> G completions per prompt, scored, filtered, refilled ->
guided samples for unsolved groups -> padded tensors and the forward passes the algorithm needs (pi_old,
reference, teacher, critic) -> advantages on the whole rollout -> mu epochs of minibatch optimizer steps ->
the sampler takes the new weights. pi_old is the sampler's own log-probs: no extra forward pass (but on
guided rows, whose sampler log-probs are after another prompt). What one algorithm alone needs lives in
a file of its own: rl_guided, rl_replay, rl_costs, rl_state, rl_params.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from alignflow.core import seeds
from alignflow.core.environments.episodes import Episodes
from alignflow.core.train.adapters import AdaptersOff
from alignflow.core.train.datasets import read_rows
from alignflow.core.train.engine import Engine
from alignflow.core.errors import SpecError
from alignflow.core.train.models import token_logprobs
from alignflow.core.progress import progress
from alignflow.core.rewards import RewardSet
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.evaluation import evaluate_model
from alignflow.flows.stages.rl.costs import check_costs, cost_label, reward_components, turn_anchor
from alignflow.flows.stages.rl.guided import rescore_guided, with_guided
from alignflow.flows.stages.rl.asynchronous import AsyncRollouts, async_next, start_async
from alignflow.flows.stages.rl.params import attach_parameters, detach_parameters
from alignflow.flows.stages.rl.prompts import PromptDraw
from alignflow.flows.stages.rl.replay import ReplayBuffer, replay_metrics, restore, with_replayed
from alignflow.flows.stages.rl.rollout import Batch, Samples, collect, completion_budget, rollout_metrics, to_batch
from alignflow.flows.stages.rl.setup import (engines, load_reference, load_teacher, minibatches_per_rollout,
                                             async_choice, process_reward, rl_steps)
from alignflow.flows.stages.rl.state import checkpoint_state, consumed_entry, resume
from alignflow.flows.stages.rl.update import Knobs, Targets, critic_values, prepare, rollout_stats, update
from alignflow.flows.stages.scoring import dataset_schema, episodes_of, reward_set
from alignflow.flows.stages.training import load_model_for, load_policy, load_tokenizer_for, model_source, \
    save_pretrained

__all__ = ["check_ranks", "rl_steps", "run_rl"]

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What every step uses: the algorithm, the models around it and the data."""

    algo: Any
    engine: Engine
    critic: Engine | None
    reference: torch.nn.Module | None
    sampler: Any
    rewards: RewardSet
    tokenizer: Any
    dataset: list[dict]
    n_minibatches: int  # optimizer steps per epoch over a rollout
    knobs: Knobs  # the settings each step's forwards and updates read
    process_reward: Any = None  # the reward that scores each step, for `requires_step_rewards`
    teacher: torch.nn.Module | None = None  # frozen, for `requires_teacher`
    replay: ReplayBuffer | None = None  # groups of earlier steps, for algorithms that replay them
    prompts: PromptDraw | None = None  # which rows each step generates for, and their success rates
    episodes: Episodes | None = None  # multi-turn episodes on the stage's environment
    consumed: list[dict] = field(default_factory=list)  # the fresh groups each update used (rl/state.py)


def build(ctx: StageContext) -> tuple[Parts, int]:
    """The algorithm, models (resumed), sampler and rewards of a stage, and its number of rollouts."""
    s = ctx.settings
    algo = ctx.resolved.algorithm.build()
    check_costs(ctx, algo)  # before any model loads
    check_ranks(ctx)
    asynchronous, why = async_choice(ctx, algo, ctx.resolved.sampler.obj)
    log.info("stage %r: asynchronous rollouts %s (%s)", ctx.name, "on" if asynchronous else "off", why)
    dataset = read_rows(ctx.inputs["dataset"], dataset_schema(ctx))
    total, n_minibatches = rl_steps(len(dataset), s), minibatches_per_rollout(ctx, algo)
    with model_source(ctx) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        model = load_policy(ctx, src)
        reference = load_reference(ctx, src) if algo.requires_reference else None
        critic = load_model_for(ctx, ctx.inputs.get("critic", src), value_head=True) if algo.requires_critic else None
    teacher = load_teacher(ctx, tokenizer) if algo.requires_teacher else None
    attach_parameters(ctx, model, algo)  # before the engine, so its optimizer steps them
    engine, critic = engines(ctx, model, critic, total, s.ppo_epochs * n_minibatches)
    reference, teacher = engine.match(reference), engine.match(teacher)  # attend as the policy does
    if algo.requires_reference and reference is None:
        reference = AdaptersOff(engine.module)
    sampler = ctx.resolved.sampler.build()
    sampler.set_precision(engine.precision)
    sampler.load(engine.module, tokenizer)
    if asynchronous:
        sampler = AsyncRollouts(sampler, engine.module, tokenizer, s.async_threads, s.max_staleness,
                                s.async_weights)
    rewards = reward_set(ctx)  # `${inputs.reward_model}` / `${inputs.prm}` in a config become those inputs
    process = process_reward(ctx, rewards) if algo.requires_step_rewards else None
    replay, prompts, consumed = resume(ctx, algo, engine.data_state or {}, len(dataset))  # goes on as it was
    return Parts(algo, engine, critic, reference, sampler, rewards, tokenizer, dataset, n_minibatches, Knobs.of(s),
                 process, teacher, replay=replay, prompts=prompts, episodes=episodes_of(ctx), consumed=consumed), total


def check_ranks(ctx: StageContext) -> None:
    """What running on several data-parallel ranks needs: a prompt per rank, minibatches of a micro-batch
    per rank, and no ZeRO-3 (each rank generates on its own, and a ZeRO-3 forward is a collective every
    rank would have to join)."""
    s, world = ctx.settings, ctx.world
    if world == 1:
        return
    if s.zero_stage == 3:
        raise SpecError(f"stage {ctx.name!r}, settings.zero_stage: an rl stage on {world} processes generates on "
                        "each separately, which ZeRO-3's sharded weights cannot: use zero_stage 0, 1 or 2")
    if s.prompts_per_step < world:
        raise SpecError(f"stage {ctx.name!r}, settings.prompts_per_step: {s.prompts_per_step} prompts cannot be "
                        f"shared by {world} processes: at least one each")
    size = s.batch_size or s.prompts_per_step * s.group_size
    if size % (s.micro_batch_size * world):
        raise SpecError(f"stage {ctx.name!r}, settings.micro_batch_size: each minibatch of {size} completions "
                        f"(batch_size, else prompts_per_step x group_size) is shared by {world} processes in "
                        f"micro-batches of {s.micro_batch_size}: {size} must be a multiple of "
                        f"{s.micro_batch_size} x {world}")


def run_rl(ctx: StageContext) -> StageResult:
    """Train the policy online on the dataset's prompts; report held-out accuracy; save the model."""
    p, total = build(ctx)
    try:  # what the environment's episodes share (a server) is held for the whole stage
        with p.episodes.hold() if p.episodes is not None else nullcontext():
            return train_and_evaluate(ctx, p, total)
    finally:  # engines and rollout workers stop whether the stage ends or fails
        p.sampler.close()


def train_and_evaluate(ctx: StageContext, p: Parts, total: int) -> StageResult:
    s = ctx.settings
    engine, critic, updates = p.engine, p.critic, s.ppo_epochs * p.n_minibatches
    metrics: dict[str, float] = {}
    first = engine.step_count // updates
    start_async(ctx, p, first, total)
    with progress(ctx.name, total=total, initial=first) as bar:
        for step in range(first, total):
            metrics = rl_step(ctx, p, step)
            if s.eval_every and (step + 1) % s.eval_every == 0 and step + 1 < total:
                metrics.update(evaluate_model(ctx, engine.module, p.tokenizer, sampler=own_sampler(p)))
            bar.update(tokens=int(metrics["perf/tokens"]), reward=metrics["reward/total/mean"],
                       accuracy=metrics["accuracy"])
            if (step + 1) % s.log_every == 0 or step + 1 == total:
                ctx.log_metrics(metrics, step + 1)
            if critic is not None:  # first, so the policy's newest checkpoint always has its critic
                critic.maybe_save({"step": step + 1})
            engine.maybe_save(checkpoint_state(step, p.algo, p.replay, p.prompts, p.consumed))
    detach_parameters(engine.module)
    out = save_pretrained(engine, p.tokenizer, ctx.work_dir / "model")
    # the last step's episode records too: `run --metrics` and the manifest hold what the plots' CSVs end with
    final = {k: v for k, v in metrics.items() if k in ("reward/total/mean", "accuracy") or k.startswith("episode/")}
    final.update(steps=float(total), **evaluate_model(ctx, engine.module, p.tokenizer, sampler=own_sampler(p)))
    ctx.log_metrics(final, total)
    headline = next((k for k in ("eval/accuracy", "accuracy", "reward/total/mean") if k in final), None)
    return StageResult(outputs={"model": out}, metrics=final, headline=headline,
                       fingerprint={**engine.fingerprint(), **async_fingerprint(s, p.sampler)})


def async_fingerprint(s, sampler) -> dict:
    """What ran: asynchronous rollouts or not, the setting, and whether the weights depend on timing (`latest`
    and `partial` weights: `reproduce` then compares the stage within its tolerance, not bit for bit)."""
    on = isinstance(sampler, AsyncRollouts)
    return {"async_rollouts": on, "async_setting": s.async_rollouts, "max_staleness": s.max_staleness if on else 0,
            "timing_dependent": on and s.async_weights != "pinned"}


def own_sampler(p: Parts):
    """The sampler of the stage's own process: evaluations generate there, outside the rollouts' staleness counts."""
    return p.sampler.inner if isinstance(p.sampler, AsyncRollouts) else p.sampler


def rl_step(ctx: StageContext, p: Parts, step: int) -> dict[str, float]:
    """Generate, score, filter, prepare, compute advantages, update; returns the step's metrics."""
    s = ctx.settings
    start = time.perf_counter()
    picked = p.replay.draw(step)  # groups of earlier steps the algorithm trains on again
    fresh, drawn, metrics = rollouts(ctx, p, step)
    metrics.update(rollout_metrics(fresh, drawn))
    metrics.update(replay_metrics(step, picked, fresh))
    kept = with_replayed(fresh, picked)  # fresh rows first, then the replayed groups
    metrics.update(async_next(ctx, p, step, rl_steps(len(p.dataset), s)))  # step + k generates while this trains
    p.consumed.append(consumed_entry(step, fresh, metrics["rollout/staleness"]))
    prepared = time.perf_counter()
    if not len(kept):  # every group filtered in every round: nothing to learn, the schedule advances
        for _ in range(p.n_minibatches * s.ppo_epochs):
            for engine in filter(None, (p.engine, p.critic)):
                engine.step()
        return {**metrics, "perf/tokens": 0.0}
    batch = scored_batch(ctx, p, kept, len(fresh), picked)
    p.replay.add(step, fresh, batch.rollout)
    advantages, returns = p.algo.advantages(batch.rollout)
    trained = time.perf_counter()
    metrics.update(update(p, Targets(batch, advantages, returns), seeds.generator(seeds.minibatches(ctx.seed, step))))
    p.sampler.update_weights(p.engine.module)
    end = time.perf_counter()
    generated = float(sum(len(c) for c in drawn.completion_ids))
    metrics.update(rollout_stats(batch.rollout, advantages))
    metrics.update(p.algo.step_metrics())
    metrics.update({"time/prepare": trained - prepared, "time/train": end - trained, "time/step": end - start,
                    "perf/tokens": generated, "perf/tokens_per_s": generated / (end - start),
                    "perf/completions_per_s": len(drawn) / (end - start)})
    return metrics


def rollouts(ctx: StageContext, p: Parts, step: int) -> tuple[Samples, Samples, dict[str, float]]:
    """The step's kept samples (its guided samples after them), everything generated, and their metrics."""
    kept, drawn, metrics, sources = collect(ctx, p, step)
    kept, guided = with_guided(ctx, p, step, kept, sources)
    return kept, drawn, {**metrics, **guided}


def scored_batch(ctx: StageContext, p: Parts, kept: Samples, n_fresh: int, picked: list[dict]) -> Batch:
    """The padded batch with the forward passes this algorithm needs before its advantages, and no other."""
    s, k = ctx.settings, p.knobs
    logprobs = partial(policy_logprobs, temperature=k.temperature, packed=k.packed)
    fill = {}
    p.sampler.release()  # a GPU engine frees its memory while the trainer steps
    corrects = k.correction is not None  # pi_old / mu needs the trainer's pi_old
    if s.recompute_old_logprobs or corrects or (kept.logprobs is None and p.algo.needs_old_logprobs):
        fill["old_logprobs"] = logprobs(p.engine.model)
    if p.reference is not None:
        fill["ref_logprobs"] = logprobs(p.reference)
    if p.teacher is not None:
        fill["teacher_logprobs"] = logprobs(p.teacher)
    if p.critic is not None:
        fill["values"] = partial(critic_values, p.critic.model)
    batch = to_batch(kept, p.tokenizer.pad_token_id, completion_budget(s.generation, p.episodes), cost_label(p.algo),
                     reward_components(p.algo, p.rewards), turn_anchor(p.algo))
    with p.engine.autocast():  # policy, reference, teacher and critic in the policy's precision
        batch = prepare(batch.to(p.engine.device), k.micro, **fill)
        # Guided rows were sampled after a hinted prompt: their pi_old is a forward after the plain one (already
        # taken when `fill` recomputed pi_old for every row).
        batch = rescore_guided(batch, k.micro,
                               None if "old_logprobs" in fill else logprobs(p.engine.model))
    # A replayed row keeps the pi_old it was trained on when fresh, whatever `fill` recomputed for it now.
    return restore(batch, n_fresh, picked)


def policy_logprobs(model, temperature: float, packed: bool):
    """fn(ids, attention, mask) -> `model`'s log-probs of the tokens at `temperature`."""
    return lambda ids, attention, mask: token_logprobs(model, ids, attention, mask, temperature=temperature,
                                                       packed=packed)
