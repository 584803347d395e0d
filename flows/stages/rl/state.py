"""What an `rl` checkpoint keeps beside the weights: the replay buffer, the prompt draw's success table, a
`Stateful` algorithm's own state (RePO's multiplier), so that a resumed run goes on as an uninterrupted one, and
the log of the rollouts each update used (`consumed`): a run killed after step s resumes from its last checkpoint
with the log of the steps before it, so a rollout is neither used twice nor lost (each step's groups are a
function of the seed and the step, and are generated again for the steps whose updates were lost)."""

from __future__ import annotations

import hashlib

from alignflow.core.rl.capabilities import Stateful, has
from alignflow.flows.stages.rl.prompts import PromptDraw
from alignflow.flows.stages.rl.replay import ReplayBuffer


def resume(ctx, algo, state: dict, n_rows: int) -> tuple[ReplayBuffer, PromptDraw, list[dict]]:
    """The replay buffer, prompt draw and consumed log of a checkpoint's `state` (fresh ones for {}); restores
    the algorithm's own state."""
    s = ctx.settings
    if has(algo, Stateful):
        algo.load_state_dict(state.get("algorithm") or {})
    replay = ReplayBuffer(algo, s.prompts_per_step, ctx.seed, state.get("replay"), f"stage {ctx.name!r}, ")
    prompts = PromptDraw(n_rows, replay.fresh, ctx.seed, s.prompt_sampling, state.get("prompts"))
    return replay, prompts, list(state.get("consumed", []))


def consumed_entry(step: int, samples, staleness: float) -> dict:
    """The log line of the fresh groups `step`'s update used: each group id (round x prompts + position) with a
    hash of its prompt's token ids, and the most updates between their weights and this one."""
    first = {}
    for group, ids in zip(samples.group, samples.prompt_ids):
        first.setdefault(group, hashlib.sha256(repr(ids).encode()).hexdigest()[:12])
    return {"step": step, "groups": first, "staleness": staleness}


def checkpoint_state(step: int, algo, replay: ReplayBuffer, prompts: PromptDraw, consumed: list[dict]) -> dict:
    """What the checkpoint after `step` holds beside the weights."""
    own = algo.state_dict() if has(algo, Stateful) else {}
    return {"step": step + 1, "replay": replay.state(), "prompts": prompts.state(), "algorithm": own,
            "consumed": consumed}
