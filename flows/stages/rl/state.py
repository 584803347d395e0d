"""What an `rl` checkpoint keeps beside the weights: the replay buffer, the prompt draw's success table, and a
`Stateful` algorithm's own state (RePO's multiplier), so that a resumed run goes on as an uninterrupted one."""

from __future__ import annotations

from alignflow.core.rl.capabilities import Stateful, has
from alignflow.flows.stages.rl.prompts import PromptDraw
from alignflow.flows.stages.rl.replay import ReplayBuffer


def resume(ctx, algo, state: dict, n_rows: int) -> tuple[ReplayBuffer, PromptDraw]:
    """The replay buffer and prompt draw of a checkpoint's `state` (fresh ones for {}); restores the
    algorithm's own state."""
    s = ctx.settings
    if has(algo, Stateful):
        algo.load_state_dict(state.get("algorithm") or {})
    replay = ReplayBuffer(algo, s.prompts_per_step, ctx.seed, state.get("replay"), f"stage {ctx.name!r}, ")
    prompts = PromptDraw(n_rows, replay.fresh, ctx.seed, s.prompt_sampling, state.get("prompts"))
    return replay, prompts


def checkpoint_state(step: int, algo, replay: ReplayBuffer, prompts: PromptDraw) -> dict:
    """What the checkpoint after `step` holds beside the weights."""
    own = algo.state_dict() if has(algo, Stateful) else {}
    return {"step": step + 1, "replay": replay.state(), "prompts": prompts.state(), "algorithm": own}
