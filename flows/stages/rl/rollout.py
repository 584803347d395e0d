"""Rollouts of the `rl` stage: draw prompts, generate G completions each, score, filter, refill, tensorise.

Everything here is a pure function of the step (prompt draw and sampling seed), so a resumed run
regenerates exactly the rollouts an uninterrupted run would.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from alignflow.core import seeds
from alignflow.core.train.batching import pad
from alignflow.core.train.steps import token_ends
from alignflow.core.train.dist import gathered, rank_and_world
from alignflow.core.rl.algorithm import RLAlgorithm, Rollout
from alignflow.core.environments.episodes import episode_metrics
from alignflow.core.rl.capabilities import Regenerate, has
from alignflow.flows.stages.rl.costs import cost_label, reward_components, turn_anchor
from alignflow.flows.stages.scoring import generate_and_score, prompt_ids
from alignflow.flows.stages.training import step_rows

if TYPE_CHECKING:
    from alignflow.flows.stages.rl.stage import Parts


@dataclass
class Samples:
    """Scored completions as lists, one entry per completion; `group` numbers prompts across rounds."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None  # the sampler's, of the distribution it sampled from
    group: list[int]
    reward: list[float]  # weighted total
    correct: list[bool]  # the first reward scored >= 1
    truncated: list[bool]
    values: dict[str, list[float | None]]  # each reward's raw scores
    steps: list[list[tuple[int, float]]] | None = None  # process reward: (completion token, reward) per step
    counts: dict[str, float] = field(default_factory=dict)  # reward/NAME/failed and rewards' own counts
    guided: list[bool] | None = None  # sampled after `algo.guided_prompt` (see rl_guided); None: no such row
    loss_mask: list[list[int]] | None = None  # episodes: 1 on the model's completion tokens, 0 on the environment's
    episodes: dict[str, list] | None = None  # episodes: turns, tool calls, ... per sample (core/environments)

    def __len__(self) -> int:
        return len(self.group)

    def take(self, rows: list[int]) -> "Samples":
        def pick(v):
            if v is self.counts:
                return dict(v)  # counts of the whole round, not per sample
            if isinstance(v, dict):
                return {k: pick(x) for k, x in v.items()}
            return None if v is None else [v[i] for i in rows]

        return Samples(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    @staticmethod
    def join(parts: list["Samples"]) -> "Samples":
        first = parts[0]

        def cat(name):
            if getattr(first, name) is None and name != "guided":
                return None
            if name in ("values", "episodes"):
                return {k: sum((getattr(p, name)[k] for p in parts), []) for k in getattr(first, name)}
            if name == "counts":
                return {k: sum(p.counts.get(k, 0.0) for p in parts) for k in {k for p in parts for k in p.counts}}
            if name == "guided":  # rounds carry no flags, guided samples all True: a row without one is not guided
                return None if all(p.guided is None for p in parts) else sum(
                    (p.guided if p.guided is not None else [False] * len(p) for p in parts), [])
            return sum((getattr(p, name) for p in parts), [])

        return Samples(**{f.name: cat(f.name) for f in fields(first)})


@dataclass
class Batch:
    """A rollout as the trainer sees it: right-padded prompt+completion ids and the `Rollout` on them.

    The Rollout's T axis is the sequence axis: `response_mask` marks completion tokens (EOS included)
    and log-probs sit at the position of the token they score.
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    rollout: Rollout

    def to(self, device) -> "Batch":
        moved = {f.name: getattr(self.rollout, f.name).to(device) for f in fields(self.rollout)
                 if isinstance(getattr(self.rollout, f.name), torch.Tensor)}
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), replace(self.rollout, **moved))

    def view(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, attention, response mask) of `rows`, cut to their own longest sequence."""
        attn = self.attention_mask[rows]
        width = int(attn.sum(-1).max())
        return self.input_ids[rows, :width], attn[:, :width], self.rollout.response_mask[rows, :width]


def round_prompts(step: int, round_: int, n_rows: int, k: int, seed: int) -> list[int]:
    """Rows drawn at `step` for generation round `round_` (round 0 walks the seeded epochs)."""
    return step_rows(step, n_rows, k, seeds.round_rows(seed, round_))


def round_share(ctx, step: int, round_: int, dataset: list[dict], draw=None,
                keep: bool = False) -> tuple[list[int], list[int], int]:
    """A round's dataset rows (`draw.rows`, a `PromptDraw`, else seeded epochs of `prompts_per_step`), the
    positions of this rank's share of them, and its sampling seed (a function of step, round and rank). `keep`:
    the draw holds these rows for the step's own call (a round asked of the rollout worker ahead of its step)."""
    rank, world = rank_and_world()
    if draw is not None:
        index = draw.rows(step, round_, keep)
    else:
        index = round_prompts(step, round_, len(dataset), ctx.settings.prompts_per_step, ctx.seed)
    return index, list(range(rank, len(index), world)), seeds.rollout(ctx.seed, step, round_, rank)


def generate_round(p: "Parts", rows: list[dict], groups: list[int], G: int, gen, seed: int,
                   episodes=None) -> tuple[Samples, dict[str, float]]:
    """G completions (with `episodes`, G multi-turn episodes) for each of `rows` (group `groups[i]` for row i)
    from `p.sampler`, scored by `p.rewards` (and their steps, by `p.process_reward` if any); timings."""
    start = time.perf_counter()
    tokenizer, process_reward = p.tokenizer, p.process_reward
    scored = generate_and_score(p.sampler, tokenizer, rows, G, gen, seed, p.rewards, episodes=episodes)
    g = scored.generation
    gen_s = g.timings.get("generate_s", time.perf_counter() - start)
    prompts = prompt_ids(tokenizer, rows) if g.prompt_ids is None else None
    steps = None
    if process_reward is not None:
        spans = process_reward.step_rewards([rows[i]["prompt"] for i in g.prompt_index], g.texts)
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        steps = [list(zip(token_ends(decode, ids, [end for end, _ in sp]), [r for _, r in sp]))
                 for ids, sp in zip(g.completion_ids, spans)]
    samples = Samples(
        prompt_ids=[prompts[i] for i in g.prompt_index] if prompts is not None else g.prompt_ids,
        completion_ids=g.completion_ids,
        logprobs=g.logprobs, group=[groups[i] for i in g.prompt_index], reward=scored.rewards.total,
        correct=scored.correct, truncated=g.truncated, values=scored.rewards.values, steps=steps,
        counts={k: v for k, v in scored.rewards.metrics.items()
                if k.startswith("reward/") and not k.endswith(("/mean", "/none"))},
        loss_mask=g.loss_mask,  # an episode's conversation stays behind: training needs only its counts
        episodes=None if g.episodes is None else {k: v for k, v in g.episodes.items() if k != "messages"},
    )
    return samples, {"generate": gen_s, "score": time.perf_counter() - start - gen_s}


def collect(ctx, p: "Parts", step: int):
    """One step's samples: generate and score rounds of `p.dataset`'s rows, keep what `algo.filter_groups` keeps,
    refill up to `algo.max_gen_batches` rounds (0: until full) for a `Regenerate` algorithm, trim to
    `draw.per_step` groups (`draw`: `p.prompts`; without a `PromptDraw`: `prompts_per_step`); the draw records
    every completion's success. Returns the kept samples, all drawn ones, metrics, and each group's dataset row.

    On several ranks each generates for its share of a round's prompts, and every rank then holds
    the whole round, so the filter, the advantages and the update see the rollout one process would.
    """
    s, algo, dataset, draw, episodes = ctx.settings, p.algo, p.dataset, p.prompts, p.episodes
    G, want = s.group_size, s.prompts_per_step if draw is None else draw.per_step
    kept, n_kept, drawn, rounds, filtered = [], 0, [], 0, 0
    sources = {}  # group id -> its dataset row
    times = {"generate": 0.0, "score": 0.0}
    cap, cost = algo.max_gen_batches if has(algo, Regenerate) else 1, cost_label(algo)
    components, anchor = reward_components(algo, p.rewards), turn_anchor(algo)
    pad_id, budget = p.tokenizer.pad_token_id, completion_budget(s.generation, episodes)
    while n_kept < want and (cap == 0 or rounds < cap):
        index, mine, seed = round_share(ctx, step, rounds, dataset, draw)
        rows = [dataset[i] for i in index]
        sources.update({rounds * want + i: row for i, row in enumerate(rows)})
        samples, t = generate_round(p, [rows[i] for i in mine], [rounds * want + i for i in mine], G,
                                    s.generation, seed, episodes)
        samples = whole_round(samples)
        if draw is not None:
            draw.record([index[g - rounds * want] for g in samples.group], samples.correct)
        times = {k: times[k] + t[k] for k in times}
        keep = torch.ones(len(samples), dtype=torch.bool)  # the default filter keeps all: no batch to build
        if getattr(type(algo), "filter_groups", None) is not RLAlgorithm.filter_groups:
            keep = algo.filter_groups(to_batch(samples, pad_id, budget, cost, components, anchor).rollout)
        passing = sorted({samples.group[i] for i in keep.nonzero().flatten().tolist()})
        filtered += len(rows) - len(passing)
        groups = passing[: want - n_kept]
        chosen = set(groups)
        kept.append(samples.take([i for i, g in enumerate(samples.group) if g in chosen]))
        drawn.append(samples)
        n_kept += len(groups)
        rounds += 1
    metrics = {
        "sampling/rounds": float(rounds),
        "sampling/groups_filtered": float(filtered),
        "sampling/groups_kept": float(n_kept),
        **{f"time/{k}": v for k, v in times.items()},
        **(draw.metrics() if draw is not None else {}),
    }
    return Samples.join(kept), Samples.join(drawn), metrics, sources


def completion_budget(gen, episodes=None) -> int:
    """The most tokens a completion holds: `max_new_tokens`, or an episode's whole budget."""
    return gen.max_new_tokens if episodes is None else episodes.budget(gen)


def whole_round(samples: Samples) -> Samples:
    """Every rank's samples of a round on every rank, in group order (each group's in sampler order)."""
    parts = gathered(samples)
    if len(parts) == 1:
        return samples
    joined = Samples.join(parts)
    return joined.take(sorted(range(len(joined)), key=joined.group.__getitem__))


def to_batch(samples: Samples, pad_id: int, max_new_tokens: int, cost: str | None = None,
             components: dict[str, float] | None = None, anchor: str | None = None) -> Batch:
    """Right-pad prompt+completion ids to the longest sequence; the sampler's log-probs as pi_old; `cost`, the
    label of the algorithm's cost reward, gives `Rollout.costs` its raw values (NaN where it failed);
    `components` ({label: weight}) gives `Rollout.reward_values` and `reward_weights`; `anchor` (an
    `EpisodeTurns` algorithm's `anchor_state`) gives episodes their `Rollout.turns` and `states`."""
    prompt_len = [len(p) for p in samples.prompt_ids]
    seqs = [p + c for p, c in zip(samples.prompt_ids, samples.completion_ids)]
    ids = pad(seqs, pad_id)
    columns, starts = torch.arange(ids.shape[1]), torch.tensor(prompt_len)[:, None]
    ends = torch.tensor([len(x) for x in seqs])[:, None]
    attention = (columns < ends).long()
    if not samples.loss_mask:  # every completion token is the model's
        response = ((columns >= starts) & (columns < ends)).float()
    else:  # an episode's: the model's tokens only
        response = pad([[0] * n + list(m) for n, m in zip(prompt_len, samples.loss_mask)], 0).float()
    sampled = None
    if samples.logprobs is not None:
        sampled = pad([[0.0] * n + list(lp) for n, lp in zip(prompt_len, samples.logprobs)], 0.0).float()
    old = sampled if sampled is not None else torch.zeros_like(response)
    step_rewards = step_mask = None
    if samples.steps is not None:
        step_rewards, step_mask = torch.zeros_like(response), torch.zeros_like(response)
        for row, (n, steps) in enumerate(zip(prompt_len, samples.steps)):
            for token, reward in steps:
                step_rewards[row, n + token], step_mask[row, n + token] = reward, 1.0
    rollout = Rollout(
        rewards=torch.tensor(samples.reward, dtype=torch.float32), group=torch.tensor(samples.group),
        response_mask=response, old_logprobs=old, max_new_tokens=max_new_tokens,
        correct=torch.tensor(samples.correct, dtype=torch.float32), truncated=torch.tensor(samples.truncated),
        step_rewards=step_rewards, step_mask=step_mask, sampler_logprobs=sampled,
        guided=None if samples.guided is None else torch.tensor(samples.guided, dtype=torch.bool),
        costs=None if cost is None else raw_values(samples, [cost])[:, 0],
        reward_values=None if components is None else raw_values(samples, list(components)),
        reward_weights=None if components is None else tuple(components.values()),
        **({} if anchor is None or samples.episodes is None else turn_tensors(samples, prompt_len, response, anchor)),
    )
    return Batch(ids, attention, rollout)


def turn_tensors(samples: Samples, prompt_len: list[int], response: torch.Tensor, anchor: str) -> dict:
    """`Rollout.turns` and `states` [B, T]: each model token's turn and the `anchor` hash of its state (the
    episodes' `turn_starts` and `turn_{anchor}`); -1 and 0 on every other position."""
    turns = torch.full(response.shape, -1, dtype=torch.long)
    states = torch.zeros(response.shape, dtype=torch.long)
    hashes = samples.episodes[f"turn_{anchor}"]
    for row, (n, starts) in enumerate(zip(prompt_len, samples.episodes["turn_starts"])):
        ends = starts[1:] + [response.shape[1] - n]
        for k, (lo, hi) in enumerate(zip(starts, ends)):
            turns[row, n + lo: n + hi], states[row, n + lo: n + hi] = k, hashes[row][k]
    model = response.bool()
    return {"turns": turns.where(model, -1), "states": states.where(model, 0)}


def raw_values(samples: Samples, labels: list[str]) -> torch.Tensor:
    """[B, K] the raw values of the rewards `labels`, NaN where one returned None."""
    return torch.tensor([[math.nan if v is None else v for v in samples.values[label]] for label in labels],
                        dtype=torch.float32).reshape(len(labels), len(samples)).T


def rollout_metrics(kept: Samples, drawn: Samples) -> dict[str, float]:
    """Rewards (mean/std of each), accuracy and lengths of everything generated this step."""
    lengths = torch.tensor([len(c) for c in drawn.completion_ids], dtype=torch.float32)
    metrics = {
        "accuracy": sum(drawn.correct) / len(drawn),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/truncated": sum(drawn.truncated) / len(drawn),
        **_mean_std("reward/total", drawn.reward),
        "train_batch/reward_mean": sum(kept.reward) / max(len(kept), 1),
    }
    for name, values in drawn.values.items():
        metrics.update(_mean_std(f"reward/{name}", [v for v in values if v is not None]))
        metrics[f"reward/{name}/none"] = float(sum(v is None for v in values))
    metrics.update(drawn.counts)  # e.g. reward/code_exec/timeout, reward/NAME/failed
    if drawn.episodes is not None:
        metrics.update(episode_metrics(drawn.episodes))
    return metrics


def _mean_std(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    t = torch.tensor(values, dtype=torch.float32)
    return {f"{prefix}/mean": t.mean().item(), f"{prefix}/std": t.std(unbiased=False).item()}
