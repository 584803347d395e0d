"""What an `rl` stage needs before its first step: its length, its batch shapes, and the frozen models and
engines around the policy, each checked against the stage's settings."""

from __future__ import annotations

import math
import os

import torch

from alignflow.core import seeds
from alignflow.core.train.engine import Engine, frozen
from alignflow.core.errors import SpecError
from alignflow.core.rewards import RewardSet
from alignflow.flows.options import AUTO_ASYNC_ENV
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.training import load_model_for, load_tokenizer_for, lora_rank, model_source


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
    torch.manual_seed(seeds.init(ctx.seed))
    engine = Engine.create(model, train, total * updates, ctx.checkpoint_dir.parent,
                           auto_precision=ctx.options.auto_precision)
    if critic is not None:
        # the policy's resolved precision: both run in one autocast (rl/update.py's micro_step)
        critic_settings = train.model_copy(update={"lr": s.critic_lr or s.lr, "precision": engine.precision})
        critic = Engine.create(critic, critic_settings, total * updates, ctx.checkpoint_dir / "critic",
                               resume=engine.step_count)
    return engine, critic


def async_choice(ctx: StageContext, algo, sampler_cls) -> tuple[bool, str]:
    """Whether the stage's rollouts run asynchronously, and why. The worker holds a copy of the policy module: it
    needs whole weights and a sampler that generates on a module (one with an engine of its own, as `vllm`,
    already runs apart); `true` where it cannot is an error. `max_staleness: 0` is the synchronous stage. `auto`
    turns it on only where it can pay: the algorithm corrects for the lag with its ratio to pi_old (the sampler's
    log-probs, not recomputed), one process on a CPU (on a GPU the worker would share the device), and
    `async_threads` cores beyond the stage's torch threads (a worker on the trainer's cores slows it as much as
    it saves)."""
    s, name = ctx.settings, ctx.spec.sampler.name
    where = f"stage {ctx.name!r}, settings.async_rollouts"
    world = ctx.world
    cannot = ("ZeRO-3 shards the weights the rollout worker needs whole: use zero_stage 0-2"
              if s.zero_stage == 3 else
              f"{world} processes: asynchronous rollouts run beside one process (each rank would need a worker of "
              "its own, which is not supported yet); run on one process or set async_rollouts: false"
              if world > 1 and s.max_staleness > 0 else
              f"sampler {name!r} runs an engine of its own; asynchronous rollouts are for samplers that generate "
              "on the policy module (`hf`)" if sampler_cls.loads_checkpoint else None)
    if s.async_rollouts is True and cannot:
        raise SpecError(f"{where}: {cannot}")
    if s.async_weights == "partial" and not hasattr(sampler_cls, "preempt"):
        raise SpecError(f"stage {ctx.name!r}, settings.async_weights: partial rollouts need a sampler that can switch "
                        f"weights mid-generation (`hf`); sampler {name!r} cannot: use pinned or latest")
    if s.max_staleness == 0:
        return False, "max_staleness 0: synchronous"
    if s.async_rollouts != "auto":
        return s.async_rollouts, "set"
    if not ctx.options.auto_async:  # the run's options (ALIGNFLOW_AUTO_OVERLAP=false)
        return False, f"auto: {AUTO_ASYNC_ENV}"
    cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    why = (cannot
           or (not algo.needs_old_logprobs and f"algorithm {ctx.spec.algorithm.name!r} takes no ratio to pi_old")
           or (s.recompute_old_logprobs and "recompute_old_logprobs: pi_old would not be the generating weights")
           or (torch.cuda.is_available() and "a GPU")
           or (cores - threads < s.async_threads and f"no spare core: {threads} torch threads on {cores} cores"))
    if why:
        return False, f"auto: {why}"
    return True, f"auto: {cores - threads} of {cores} cores spare, the worker takes {s.async_threads}"


def process_reward(ctx: StageContext, rewards: RewardSet):
    """The one reward of the stage that scores each step (has `step_rewards`, as the `prm` reward)."""
    found = [r for r in rewards.rewards if hasattr(r.fn, "step_rewards")]
    if len(found) != 1:
        raise SpecError(f"stage {ctx.name!r}: algorithm {ctx.spec.algorithm.name!r} learns from step rewards "
                        f"and needs exactly one reward that scores steps (such as `prm`) among its rewards; "
                        f"found {len(found)} ({', '.join(r.name for r in rewards.rewards)})")
    return found[0].fn
