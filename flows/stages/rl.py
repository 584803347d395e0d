"""The `rl` stage: online RL with any registered RL algorithm, driven by its flags alone.

Per step: draw prompts -> G completions each through the sampler -> rewards -> the algorithm's
group filter (refilling rounds) -> guided samples for unsolved groups, when the algorithm asks for them ->
groups of earlier steps, when the algorithm replays -> padded tensors -> reference log-probs / critic values
when the algorithm needs them -> advantages on the whole rollout -> mu epochs of minibatch optimizer steps ->
the sampler takes the new weights. pi_old is the sampler's own log-probs: no extra forward pass (but on
guided rows, whose sampler log-probs are after another prompt).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from alignflow.core.data import load_rows
from alignflow.core.engine import Engine, frozen
from alignflow.core.errors import SpecError
from alignflow.core.adapters import AdaptersOff
from alignflow.core.models import token_logprobs
from alignflow.core.progress import progress
from alignflow.core.rl import cost_reward_problem
from alignflow.core.rewards import RewardSet
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.evaluation import evaluate_model
from alignflow.flows.stages.rl_overlap import Overlapped
from alignflow.flows.stages.rl_prompts import PromptDraw
from alignflow.flows.stages.rl_replay import ReplayBuffer, replay_metrics, restore, with_replayed
from alignflow.flows.stages.rl_rollout import collect, rollout_metrics, round_share, to_batch
from alignflow.flows.stages.rl_update import critic_values, prepare, rescore_guided, rollout_stats, update
from alignflow.flows.stages.scoring import CHUNK, prompt_ids, reward_set
from alignflow.flows.stages.training import (load_model_for, load_policy, load_tokenizer_for, lora_rank,
                                             model_source, plugin, save_pretrained)

EXTRA = "rl_extra_parameters"  # algorithm parameters (λ-GRPO's λ) ride on the policy module


def rl_steps(n_rows: int, s) -> int:
    """Rollouts to train on: `max_steps`, or `epochs` passes over the prompts."""
    if s.max_steps is not None:
        return s.max_steps
    if n_rows < s.prompts_per_step:
        raise SpecError(f"prompts_per_step={s.prompts_per_step} is larger than the dataset ({n_rows} rows)")
    return max(1, math.ceil(s.epochs * (n_rows // s.prompts_per_step)))


def minibatches_per_rollout(ctx: StageContext, algo) -> int:
    """Optimizer steps per epoch over a rollout; checks that batches divide into whole groups."""
    s, where = ctx.settings, f"stage {ctx.name!r}, settings"
    rollout = s.prompts_per_step * s.group_size
    size = s.batch_size or rollout
    if rollout % size or size % s.micro_batch_size:
        raise SpecError(f"{where}: batch_size={size} must divide prompts_per_step x group_size={rollout} "
                        f"and be a multiple of micro_batch_size={s.micro_batch_size}")
    if algo.requires_whole_groups and s.micro_batch_size % s.group_size:
        raise SpecError(f"{where}.micro_batch_size: {ctx.spec.algorithm.name} needs whole groups per micro-batch:"
                        f" a multiple of group_size={s.group_size}, got {s.micro_batch_size}")
    return rollout // size


def engine_settings(s):
    """The settings an engine sees: batch_size None means the whole rollout."""
    return s.model_copy(update={"batch_size": s.batch_size or s.prompts_per_step * s.group_size})


def load_reference(ctx: StageContext, policy_source: str):
    """The frozen reference: the `reference` input, else the initial policy; None for a LoRA policy without a
    `reference` input, whose base (its adapters switched off, `AdaptersOff`) is that initial policy."""
    settings = engine_settings(ctx.settings)  # a ZeRO-3 reference is a DeepSpeed engine too
    if "reference" not in ctx.inputs:
        return None if lora_rank(ctx.settings) else frozen(load_model_for(ctx, policy_source), settings)
    with model_source(ctx, "reference") as src:
        return frozen(load_model_for(ctx, src), settings)


def load_teacher(ctx: StageContext, tokenizer):
    """The frozen teacher of a `requires_teacher` algorithm: the `teacher` input, which scores the
    student's token ids and so must share its vocabulary."""
    where = f"stage {ctx.name!r}, inputs.teacher"
    if "teacher" not in ctx.inputs:
        raise SpecError(f"{where}: algorithm {ctx.spec.algorithm.name!r} learns from a teacher: give its model "
                        "path or `stage:NAME`")
    with model_source(ctx, "teacher") as src:
        theirs, ours = load_tokenizer_for(ctx, src).get_vocab(), tokenizer.get_vocab()
        if theirs != ours:
            differing = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            raise SpecError(f"{where}: the teacher's vocabulary ({len(theirs)} tokens) is not the student's "
                            f"({len(ours)}; first differences {differing}): the teacher scores the student's "
                            "token ids, so both need the same tokenizer")
        return frozen(load_model_for(ctx, src), engine_settings(ctx.settings))


def engines(ctx: StageContext, model, critic, total: int, updates: int):
    """The policy engine (resumed) and the critic engine resumed at the policy's step."""
    s = ctx.settings
    # The engine counts optimizer steps: `updates` per rollout, checkpoints on rollout boundaries.
    train = engine_settings(s).model_copy(update={"save_every": s.save_every * updates})
    torch.manual_seed(ctx.seed)
    engine = Engine.create(model, train, total * updates, ctx.checkpoint_dir.parent)
    if critic is not None:
        critic_settings = train.model_copy(update={"lr": s.critic_lr or s.lr})
        critic = Engine.create(critic, critic_settings, total * updates, ctx.checkpoint_dir / "critic",
                               resume=engine.step_count)
    return engine, critic


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
    process_reward: Any = None  # the reward that scores each step, for `requires_step_rewards`
    teacher: torch.nn.Module | None = None  # frozen, for `requires_teacher`
    replay: ReplayBuffer | None = None  # groups of earlier steps, for algorithms that replay them
    prompts: PromptDraw | None = None  # which rows each step generates for, and their success rates


def build(ctx: StageContext) -> tuple[Parts, int]:
    """The algorithm, models (resumed), sampler and rewards of a stage, and its number of rollouts."""
    s = ctx.settings
    algo = plugin(ctx, ctx.spec.algorithm, ctx.plugins.algorithms, "algorithm")
    if problem := cost_reward_problem(algo, ctx.spec.rewards):  # before any model loads
        raise SpecError(f"stage {ctx.name!r}, {problem}")
    check_ranks(ctx)
    if s.overlap_rollouts:
        check_overlap(ctx, ctx.plugins.samplers.get(ctx.spec.sampler.name))
    dataset = load_rows(ctx.inputs["dataset"], "prompt_answer").to_list()
    total, n_minibatches = rl_steps(len(dataset), s), minibatches_per_rollout(ctx, algo)
    with model_source(ctx) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        model = load_policy(ctx, src)
        reference = load_reference(ctx, src) if algo.requires_reference else None
        critic = load_model_for(ctx, ctx.inputs.get("critic", src), value_head=True) if algo.requires_critic else None
    teacher = load_teacher(ctx, tokenizer) if algo.requires_teacher else None
    if algo.extra_parameters():  # so the optimizer steps them and checkpoints hold them
        if s.zero_stage == 3:  # ZeRO-3 partitions them, and the loss reads them outside any forward
            raise SpecError(f"stage {ctx.name!r}, settings.zero_stage: {ctx.spec.algorithm.name} trains its own "
                            "parameters in the loss, which ZeRO-3 would partition: use zero_stage 0, 1 or 2")
        model.add_module(EXTRA, torch.nn.ParameterList(algo.extra_parameters()))
    engine, critic = engines(ctx, model, critic, total, s.ppo_epochs * n_minibatches)
    if algo.requires_reference and reference is None:
        reference = AdaptersOff(engine.module)
    sampler = plugin(ctx, ctx.spec.sampler, ctx.plugins.samplers, "sampler")
    sampler.load(engine.module, tokenizer)
    if s.overlap_rollouts:
        sampler = Overlapped(sampler, engine.module, tokenizer, s.overlap_threads)
    rewards = reward_set(ctx)  # `${inputs.reward_model}` / `${inputs.prm}` in a config become those inputs
    process = process_reward(ctx, rewards) if algo.requires_step_rewards else None
    state = engine.data_state or {}  # a resumed run goes on with its checkpoint's buffer and success table
    algo.load_state_dict(state.get("algorithm") or {})  # and the algorithm's own state (RePO's multiplier)
    replay = ReplayBuffer(algo, s.prompts_per_step, ctx.seed, state.get("replay"), f"stage {ctx.name!r}, ")
    prompts = PromptDraw(len(dataset), replay.fresh, ctx.seed, s.prompt_sampling, state.get("prompts"))
    return Parts(algo, engine, critic, reference, sampler, rewards, tokenizer, dataset, n_minibatches,
                 process, teacher, replay=replay, prompts=prompts), total


def check_ranks(ctx: StageContext) -> None:
    """What running on several data-parallel ranks needs: a prompt per rank, minibatches of a micro-batch
    per rank, and no ZeRO-3 (each rank generates on its own, and a ZeRO-3 forward is a collective every
    rank would have to join)."""
    s, world = ctx.settings, int(os.environ.get("WORLD_SIZE", "1"))
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


def check_overlap(ctx: StageContext, sampler_cls) -> None:
    """Overlapped rollouts copy the policy module into a worker: whole weights, and a sampler that
    generates on a module (a sampler with an engine of its own, as `vllm`, already runs apart)."""
    where = f"stage {ctx.name!r}, settings.overlap_rollouts"
    if ctx.settings.zero_stage == 3:
        raise SpecError(f"{where}: the rollout worker needs whole weights, which ZeRO-3 shards: use zero_stage 0-2")
    if sampler_cls.loads_checkpoint:
        raise SpecError(f"{where}: sampler {ctx.spec.sampler.name!r} runs an engine of its own; overlapped "
                        "rollouts are for samplers that generate on the policy module (`hf`)")


def process_reward(ctx: StageContext, rewards: RewardSet):
    """The one reward of the stage that scores each step (has `step_rewards`, as the `prm` reward)."""
    found = [r for r in rewards.rewards if hasattr(r.fn, "step_rewards")]
    if len(found) != 1:
        raise SpecError(f"stage {ctx.name!r}: algorithm {ctx.spec.algorithm.name!r} learns from step rewards "
                        f"and needs exactly one reward that scores steps (such as `prm`) among its rewards; "
                        f"found {len(found)} ({', '.join(r.name for r in rewards.rewards)})")
    return found[0].fn


def run_rl(ctx: StageContext) -> StageResult:
    """Train the policy online on the dataset's prompts; report held-out accuracy; save the model."""
    p, total = build(ctx)
    try:
        return train_and_evaluate(ctx, p, total)
    finally:  # engines and rollout workers stop whether the stage ends or fails
        p.sampler.close()


def train_and_evaluate(ctx: StageContext, p: Parts, total: int) -> StageResult:
    s = ctx.settings
    engine, critic, updates = p.engine, p.critic, s.ppo_epochs * p.n_minibatches
    metrics: dict[str, float] = {}
    with progress(ctx.name, total=total, initial=engine.step_count // updates) as bar:
        for step in range(engine.step_count // updates, total):
            metrics = rl_step(ctx, p, step)
            if s.eval_every and (step + 1) % s.eval_every == 0 and step + 1 < total:
                metrics.update(evaluate_model(ctx, engine.module, p.tokenizer, sampler=p.sampler))
            bar.update(tokens=int(metrics["perf/tokens"]), reward=metrics["reward/total/mean"],
                       accuracy=metrics["accuracy"])
            if (step + 1) % s.log_every == 0 or step + 1 == total:
                ctx.log_metrics(metrics, step + 1)
            if critic is not None:  # first, so the policy's newest checkpoint always has its critic
                critic.maybe_save({"step": step + 1})
            engine.maybe_save({"step": step + 1, "replay": p.replay.state(), "prompts": p.prompts.state(),
                               "algorithm": p.algo.state_dict()})
    if hasattr(engine.module, EXTRA):
        delattr(engine.module, EXTRA)  # the output is an ordinary transformers checkpoint
    out = save_pretrained(engine, p.tokenizer, ctx.work_dir / "model")
    final = {k: metrics[k] for k in ("reward/total/mean", "accuracy") if k in metrics}
    final.update(steps=float(total), **evaluate_model(ctx, engine.module, p.tokenizer, sampler=p.sampler))
    ctx.log_metrics(final, total)
    headline = next((k for k in ("eval/accuracy", "accuracy", "reward/total/mean") if k in final), None)
    return StageResult(outputs={"model": out}, metrics=final, headline=headline)


def prefetch(ctx: StageContext, p: Parts, step: int) -> None:
    """Start `step`'s first generation round in the overlapped sampler: the same calls `collect` makes."""
    index, mine, seed = round_share(ctx, step, 0, p.dataset, p.prompts)
    ids = prompt_ids(p.tokenizer, [p.dataset[index[i]] for i in mine])
    for lo in range(0, len(ids), CHUNK):
        p.sampler.prefetch(ids[lo: lo + CHUNK], ctx.settings.group_size, ctx.settings.generation, seed + lo)


def rl_step(ctx: StageContext, p: Parts, step: int) -> dict[str, float]:
    """Generate, score, filter, prepare, compute advantages, update; returns the step's metrics."""
    s, gen = ctx.settings, ctx.settings.generation
    start = time.perf_counter()
    picked = p.replay.draw(step)  # groups of earlier steps the algorithm trains on again
    kept, drawn, metrics = collect(ctx, step, p.dataset, p.sampler, p.tokenizer, p.rewards, p.algo,
                                   p.tokenizer.pad_token_id, p.process_reward, p.prompts)
    metrics.update(rollout_metrics(kept, drawn))
    metrics.update(replay_metrics(step, picked, kept))
    fresh, kept = kept, with_replayed(kept, picked)  # fresh rows first, then the replayed groups
    overlapped = isinstance(p.sampler, Overlapped)
    # Optimizer updates between the weights that generated this step's samples and these.
    metrics["rollout/staleness"] = float(p.sampler.take_staleness()) if overlapped else 0.0
    if overlapped and step + 1 < rl_steps(len(p.dataset), s):
        prefetch(ctx, p, step + 1)  # generates on these weights while this step trains
    prepared = time.perf_counter()
    if not len(kept):  # every group filtered in every round: nothing to learn, the schedule advances
        for _ in range(p.n_minibatches * s.ppo_epochs):
            for engine in filter(None, (p.engine, p.critic)):
                engine.step()
        return {**metrics, "perf/tokens": 0.0}
    temperature = gen.temperature if gen.temperature > 0 else 1.0  # greedy log-probs: the plain softmax

    def logprobs(model):
        return lambda ids, attention, mask: token_logprobs(model, ids, attention, mask, temperature=temperature,
                                                           packed=s.pack_sequences)

    fill = {}  # the forward passes this algorithm needs before its advantages, and no other
    p.sampler.release()  # a GPU engine frees its memory while the trainer steps
    if s.recompute_old_logprobs or s.tis_cap is not None or (kept.logprobs is None and p.algo.needs_old_logprobs):
        fill["old_logprobs"] = logprobs(p.engine.model)
    if p.reference is not None:
        fill["ref_logprobs"] = logprobs(p.reference)
    if p.teacher is not None:
        fill["teacher_logprobs"] = logprobs(p.teacher)
    if p.critic is not None:
        fill["values"] = partial(critic_values, p.critic.model)
    batch = to_batch(kept, p.tokenizer.pad_token_id, gen.max_new_tokens, p.algo.cost_reward).to(p.engine.device)
    batch = prepare(batch, s.micro_batch_size, **fill)
    # Guided rows were sampled after a hinted prompt: their pi_old is a forward after the plain one (already
    # taken when `fill` recomputed pi_old for every row).
    batch = rescore_guided(batch, s.micro_batch_size, None if "old_logprobs" in fill else logprobs(p.engine.model))
    # A replayed row keeps the pi_old it was trained on when fresh, whatever `fill` recomputed for it now.
    batch = restore(batch, len(fresh), picked)
    p.replay.add(step, fresh, batch.rollout)
    advantages, returns = p.algo.advantages(batch.rollout)
    trained = time.perf_counter()
    metrics.update(update(p.engine, p.critic, p.algo, batch, advantages, returns, s, p.n_minibatches, temperature,
                          torch.Generator().manual_seed(ctx.seed * 1_000_003 + step)))
    p.sampler.update_weights(p.engine.module)
    end = time.perf_counter()
    generated = float(sum(len(c) for c in drawn.completion_ids))
    metrics.update(rollout_stats(batch.rollout, advantages))
    metrics.update(p.algo.step_metrics())
    metrics.update({"time/prepare": trained - prepared, "time/train": end - trained, "time/step": end - start,
                    "perf/tokens": generated, "perf/tokens_per_s": generated / (end - start),
                    "perf/completions_per_s": len(drawn) / (end - start)})
    return metrics
