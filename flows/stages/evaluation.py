"""Score a model on a stage's `eval_dataset` with the stage's rewards (accuracy, pass@1, rewards)."""

from __future__ import annotations

from alignflow.core.train.datasets import read_rows
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.scoring import accuracy_metrics, episodes_of, eval_schema, generate_and_score, reward_set


def evaluate_model(ctx: StageContext, model, tokenizer, prefix: str = "eval/", sampler=None) -> dict[str, float]:
    """Greedy (per `eval_generation`) completions (or episodes) for `eval_dataset` prompts, scored; {} without
    rewards or an environment.

    `sampler`: one that already holds `model`'s weights (the rl stage's own); else the stage's sampler is
    loaded for this evaluation and closed after it. Every rank calls it: the ranks share the prompts,
    unless under ZeRO-3, where each forward pass is a collective and so every rank generates every
    completion alike.
    """
    if "eval_dataset" not in ctx.inputs or not (ctx.spec.rewards or ctx.spec.environment):
        return {}
    s = ctx.settings
    rows = read_rows(ctx.inputs["eval_dataset"], eval_schema(ctx))[: s.eval_limit]
    own = sampler is None
    if own:
        sampler = ctx.resolved.sampler.build()
        sampler.load(model, tokenizer)
    try:
        scored = generate_and_score(sampler, tokenizer, rows, 1, s.eval_generation, ctx.seed, reward_set(ctx),
                                    shard=s.zero_stage != 3, episodes=episodes_of(ctx))
    finally:
        if own:
            sampler.close()
    return {prefix + k: v for k, v in accuracy_metrics(scored).items()}
