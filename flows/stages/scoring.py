"""Generate completions for dataset prompts and score them: shared by the sampling stages and rl.

A completion is *correct* when the first reward listed scores at least 1 (exact for 0/1 verifiers,
all tests passed for `code_exec`): accuracy and pass@k count those. An episode whose environment said whether
it was won (`Step.success`) is correct when it was, whatever its (shaped) reward.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from alignflow.core import seeds
from alignflow.core.errors import SpecError
from alignflow.core.metrics import mean_pass_at_k
from alignflow.core.spec.kinds import episode_rows, stage_kind
from alignflow.core.progress import progress
from alignflow.core.train.dist import gathered, rank_and_world
from alignflow.core.environments.episodes import Episodes, episode_metrics
from alignflow.core.rewards import Reward, RewardOutput, RewardSet, reward_labels
from alignflow.core.sampling import Generation
from alignflow.flows.stages.training import load_model_for, load_tokenizer_for, model_source

CORRECT_AT = 1.0 - 1e-6
CHUNK = 64  # prompts per sampler call, each call seeded by its first prompt's place


@dataclass
class Scored:
    """Completions for P prompts x n, their rewards, and which are correct."""

    rows: list[dict]  # the dataset rows, one per prompt
    n: int
    generation: Generation
    rewards: RewardOutput
    correct: list[bool]

    def counts(self) -> list[int]:
        """Correct completions (episodes: their final samples) per prompt."""
        out = [0] * len(self.rows)
        for i, ok in zip(self.generation.prompt_index, self.final_correct()):
            out[i] += ok
        return out

    def final_correct(self) -> list[bool]:
        """`correct`, with False on the samples of a driven episode before its last (one count per episode)."""
        final = (self.generation.episodes or {}).get("final")
        return self.correct if final is None else [ok and f for ok, f in zip(self.correct, final)]


def dataset_schema(ctx) -> str | None:
    """The row schema of the stage's `dataset` (core/spec/kinds.py); with an environment, `answer` only where a
    reward or the algorithm reads it."""
    return stage_kind(ctx.spec.kind).dataset_schema(ctx.spec, ctx.plugins)


def eval_schema(ctx) -> str:
    """The row schema of a training stage's `eval_dataset`: prompts and answers, or an `rl` stage's episode rows."""
    return "prompt_answer" if ctx.spec.environment is None else episode_rows(ctx.spec, ctx.plugins)


def reward_set(ctx) -> RewardSet:
    """The stage's rewards; a config value `${inputs.NAME}` becomes that resolved stage input. With an
    environment its episode reward comes first (so it decides which samples are correct), under its name."""
    labels = reward_labels([ref.name for ref in ctx.spec.rewards])
    rewards = [Reward(label, ref.weight, with_inputs(ctx, ref.config, use).build())
               for label, ref, use in zip(labels, ctx.spec.rewards, ctx.resolved.rewards, strict=True)]
    env = ctx.spec.environment
    if env is not None:
        rewards.insert(0, Reward(env.name, env.weight, episode_reward))
    return RewardSet(rewards)  # labels checked unique


def with_inputs(ctx, written: dict, use):
    """`use` with each config value written `${inputs.NAME}` replaced by that input (the digest reads it as written)."""
    given = {k: value for k, v in written.items() if (value := _input_value(ctx, v)) is not v}
    return replace(use, config=use.config.model_copy(update=given)) if given else use


def episode_reward(prompts, completions, episode_reward, **columns) -> list[float]:
    """The environment's reward of each episode (the sum of its turns'), from the episodes' column."""
    return list(episode_reward)


def episodes_of(ctx) -> Episodes | None:
    """How the stage runs multi-turn episodes; None without an `environment:`."""
    env = ctx.spec.environment
    if env is None:
        return None
    use = ctx.resolved.environment
    return Episodes(use.obj, use.config, env.max_turns, env.max_tokens, env.tool_format, env.name, list(env.mcp))


@contextmanager
def held_episodes(ctx) -> Iterator[Episodes | None]:
    """`episodes_of(ctx)`, with what its environment's batches share (a server) held for the whole block."""
    episodes = episodes_of(ctx)
    with episodes.hold() if episodes is not None else nullcontext():
        yield episodes


def _input_value(ctx, value):
    if isinstance(value, str) and value.startswith("${inputs.") and value.endswith("}"):
        name = value[len("${inputs."):-1]
        if name not in ctx.inputs:
            raise SpecError(f"stage {ctx.name!r}: a reward config refers to {value}, but the stage has no "
                            f"input {name!r} (inputs: {', '.join(ctx.inputs)})")
        return str(ctx.inputs[name])
    return value


@contextmanager
def loaded_sampler(ctx, key: str = "model"):
    """The stage's sampler loaded with model input `key` (on a GPU when there is one), and its tokenizer;
    closed (its engine stopped) when the block ends. A sampler that `loads_checkpoint` gets the folder."""
    join_ranks()  # a rank's GPU is chosen as it joins: before the model moves there
    sampler = ctx.resolved.sampler.build()
    with model_source(ctx, key) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        if sampler.loads_checkpoint:
            sampler.load(src, tokenizer)
        else:
            model = load_model_for(ctx, src, dtype="fp32").to("cuda" if torch.cuda.is_available() else "cpu")
            sampler.load(model, tokenizer)
    try:
        yield sampler, tokenizer
    finally:
        sampler.close()


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Prompt token ids exactly as the training stages tokenise them."""
    return tokenizer([r["prompt"] for r in rows]).input_ids


def columns_for(rows: list[dict], generation: Generation) -> dict[str, list]:
    """The dataset's other columns, repeated for each completion, plus token lengths (and for episodes
    `episode_reward`, `episode_turns`, ... per episode)."""
    keys = [k for k in rows[0] if k != "prompt"]
    cols = {k: [rows[i][k] for i in generation.prompt_index] for k in keys}
    cols["completion_ids"] = generation.completion_ids
    cols["completion_lengths"] = generation.lengths
    cols["truncated"] = generation.truncated
    for k, values in (generation.episodes or {}).items():
        cols[f"episode_{k}"] = values
    return cols


def join_ranks() -> tuple[int, int]:
    """(rank, world) of the launcher's process group, joined on first use; (0, 1) without a launcher."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from alignflow.core.train.engine import init_distributed  # DeepSpeed: only when there are ranks

        init_distributed()
    return rank_and_world()


def generate(sampler, tokenizer, rows: list[dict], n: int, gen, seed: int, chunk: int = CHUNK,
             shard: bool = False, episodes: Episodes | None = None) -> Generation:
    """`n` completions per row's prompt (with `episodes`, multi-turn episodes per row), `chunk` prompts at a
    time (each seeded by its place) under a progress bar. With `shard`, the ranks of a process group share
    the chunks and every rank gets the whole generation: the same completions one process would make.
    """
    parts = list(chunks(sampler, tokenizer, rows, n, gen, seed, chunk, shard, episodes))
    return Generation.concat(every_rank(parts) if shard else parts)


def chunks(sampler, tokenizer, rows: list[dict], n: int, gen, seed: int, chunk: int = CHUNK, shard: bool = False,
           episodes: Episodes | None = None):
    """(first prompt's index, Generation) of each chunk of prompts this rank samples: all of them, or with
    `shard` every world-th."""
    ids = None if episodes is not None else prompt_ids(tokenizer, rows)  # episodes start from the environment's
    rank, world = join_ranks() if shard else (0, 1)
    starts = list(range(0, len(rows), chunk))[rank::world]
    with progress("generate", total=sum(len(rows[lo: lo + chunk]) for lo in starts), unit="prompt") as bar:
        for lo in starts:
            if episodes is not None:
                part = sampler.generate_episodes(episodes, tokenizer, rows[lo: lo + chunk], n, gen,
                                                 seeds.chunk(seed, lo))
            else:
                part = sampler.generate(ids[lo: lo + chunk], n, gen, seeds.chunk(seed, lo))
            bar.update(len(rows[lo: lo + chunk]), tokens=sum(part.lengths))
            yield lo, part


def every_rank(pieces: list[tuple]) -> list[tuple]:
    """Every rank's (first prompt's index, ...) pieces on every rank, in prompt order."""
    return sorted((p for share in gathered(pieces) for p in share), key=lambda p: p[0])


def generate_and_score(sampler, tokenizer, rows: list[dict], n: int, gen, seed: int,
                       rewards: RewardSet, shard: bool = False, episodes: Episodes | None = None) -> Scored:
    """`n` completions (or episodes) per row's prompt, scored by every reward. With `shard` each rank samples
    and scores its share of the chunks (see `generate`), and every rank gets the whole."""
    if not shard or join_ranks()[1] == 1:
        generation = generate(sampler, tokenizer, rows, n, gen, seed, episodes=episodes)
        prompts = [rows[i]["prompt"] for i in generation.prompt_index]
        out, correct = judge(rewards, prompts, generation.texts, columns_for(rows, generation))
        return Scored(rows, n, generation, out, correct)
    pieces = []
    for lo, part in chunks(sampler, tokenizer, rows, n, gen, seed, shard=True, episodes=episodes):
        own = rows[lo: lo + CHUNK]
        out, correct = judge(rewards, [own[i]["prompt"] for i in part.prompt_index], part.texts,
                             columns_for(own, part))
        pieces.append((lo, part, out, correct))
    pieces = every_rank(pieces)
    generation = Generation.concat([(lo, part) for lo, part, _, _ in pieces])
    out = RewardOutput.join([out for _, _, out, _ in pieces])
    return Scored(rows, n, generation, out, [ok for *_, correct in pieces for ok in correct])


def judge(rewards: RewardSet, prompts: list[str], texts: list[str],
          columns: dict) -> tuple[RewardOutput, list[bool]]:
    """Every reward's values, and which completions are correct: an episode's `success` where its environment
    said it, else whether the first reward scored at least 1."""
    out = rewards(prompts, texts, **columns)
    first = out.values[rewards.rewards[0].name]
    said = columns.get("episode_success") or [None] * len(first)
    return out, [v is not None and v >= CORRECT_AT if ok is None else ok for v, ok in zip(first, said)]


def accuracy_metrics(scored: Scored, ks: list[int] = (1,)) -> dict[str, float]:
    """accuracy, pass@k for each k <= n, mean length, truncation share, and reward means."""
    lengths = scored.generation.lengths
    final = (scored.generation.episodes or {}).get("final")  # driven episodes: one count per episode
    metrics = {
        "accuracy": sum(scored.final_correct()) / (len(scored.correct) if final is None else sum(final)),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/truncated": sum(scored.generation.truncated) / len(lengths),
        **scored.rewards.metrics,
    }
    for k in ks:
        if k <= scored.n:
            metrics[f"pass_at_{k}"] = mean_pass_at_k(scored.counts(), scored.n, k)
    if scored.generation.episodes is not None:
        metrics.update(episode_metrics(scored.generation.episodes))
    return metrics
