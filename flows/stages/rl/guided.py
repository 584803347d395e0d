"""Guided samples in the `rl` stage, for `GuidedSamples` algorithms (ExPO's self-explanations).

For each kept group with no correct completion the stage samples `algo.guided_samples` completions after
`algo.guided_prompt(prompt, answer)` and adds those the verifier accepts as `guided` rows of the group. Their
prompt ids are the PLAIN prompt's, so every forward of the stage (pi_old, reference, the update) scores them
after the plain prompt; `rescore_guided` replaces the sampler's log-probs (after the hint) before the update.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from alignflow.core import seeds
from alignflow.core.train.dist import rank_and_world
from alignflow.core.rl.capabilities import GuidedSamples, has
from alignflow.flows.stages.rl.rollout import Batch, Samples, generate_round, whole_round
from alignflow.flows.stages.rl.update import stitched
from alignflow.flows.stages.scoring import prompt_ids

if TYPE_CHECKING:
    from alignflow.flows.stages.rl.stage import Parts


def with_guided(ctx, p: "Parts", step: int, kept: Samples, sources: dict[int, dict]) -> tuple[Samples, dict[str, float]]:
    """`kept` followed by its accepted guided samples (none unless `p.algo` has `GuidedSamples`), and the guided
    metrics. `sources[g]`: group g's dataset row."""
    if not has(p.algo, GuidedSamples):
        return kept, {}
    guided, metrics = explain(ctx, p, step, kept, sources)
    return (kept if guided is None else Samples.join([kept, guided])), metrics


def explain(ctx, p: "Parts", step: int, kept: Samples, sources: dict[int, dict]) -> tuple[Samples | None, dict[str, float]]:
    """The guided samples of the kept groups with no correct completion, scored as any completion, the
    correct ones kept as `guided` rows of their group. Not counted in the prompt draw's success table."""
    algo = p.algo
    if algo.guided_samples < 1:
        return None, {}
    start = time.perf_counter()
    solved = {g for g, ok in zip(kept.group, kept.correct) if ok}
    hints = [(g, algo.guided_prompt(sources[g]["prompt"], sources[g]["answer"]))
             for g in sorted(set(kept.group) - solved)]
    hints = [(g, hint) for g, hint in hints if hint is not None]
    metrics = {"guided/groups": float(len(hints)), "guided/rows": 0.0}
    if not hints:  # the same on every rank: all of them skip the gather below
        return None, metrics
    rank, world = rank_and_world()
    mine = hints[rank::world]
    samples = Samples([], [], [], [], [], [], [], {r.name: [] for r in p.rewards.rewards},
                      [] if p.process_reward is not None else None)  # a rank with no hint still joins the gather
    if mine:  # plain completions after the hint, even on a stage with episodes
        samples, _ = generate_round(p, [{**sources[g], "prompt": hint} for g, hint in mine], [g for g, _ in mine],
                                    algo.guided_samples, ctx.settings.generation, seeds.guided(ctx.seed, step, rank))
    samples = whole_round(samples)
    ok = [i for i, correct in enumerate(samples.correct) if correct]
    metrics.update({"guided/rows": float(len(ok)), "guided/accept_rate": len(ok) / len(samples),
                    "time/guided": time.perf_counter() - start})
    if not ok:  # no self-explanation reached the answer: nothing to add
        return None, metrics
    accepted = replace(samples.take(ok), counts={}, guided=[True] * len(ok))
    accepted.prompt_ids = prompt_ids(p.tokenizer, [sources[g] for g in accepted.group])
    return accepted, metrics


def rescore_guided(batch: Batch, micro: int, fn=None) -> Batch:
    """The batch with the `old_logprobs` and `sampler_logprobs` of its guided rows set to fn(ids, attention, mask)
    on their sequences: the plain prompt then the completion. The sampler's were of the completion after the
    hinted prompt, a distribution no loss term compares with; after this a guided row's pi_old is the policy
    after the plain prompt, and its sampler/trainer gap (the mismatch metrics, `tis_cap`) is 0. `fn=None`:
    `old_logprobs` already hold that forward (recomputed on every row), only the sampler's are replaced."""
    r = batch.rollout
    if r.guided is None or not r.guided.any():
        return batch
    rows = r.guided.nonzero().flatten()
    if fn is None:
        plain = r.old_logprobs[rows]
    else:
        plain = stitched(Batch(batch.input_ids[rows], batch.attention_mask[rows], r.select(rows)), micro, fn)
    old = r.old_logprobs.clone()
    old[rows] = plain
    sampled = None if r.sampler_logprobs is None else r.sampler_logprobs.clone()
    if sampled is not None:
        sampled[rows] = plain
    return replace(batch, rollout=replace(r, old_logprobs=old, sampler_logprobs=sampled))
