"""The `rl` stage's replay buffer, for `Replay` algorithms: groups of recent steps, kept with the log-probs
they were sampled with.

An algorithm that replays (`fresh_groups` below `prompts_per_step` and `buffer_steps` above 0, as
`offpolicy_grpo`) trains each step on its fresh groups plus up to prompts_per_step - fresh groups of the
last `buffer_steps` steps, which `algo.replay_groups` picks. A replayed row keeps the `old_logprobs` it
had when it was fresh (the sampler's, or the trainer's forward of that step under
`recompute_old_logprobs` / `tis_cap`) and its sampler log-probs: recomputing pi_old now would measure
pi_theta against itself and drop the off-policy correction. The buffer is saved with every checkpoint, so
a resumed run replays what an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from alignflow.core import seeds
from alignflow.core.errors import SpecError
from alignflow.core.train.dist import rank_and_world
from alignflow.core.rl.algorithm import Rollout
from alignflow.core.rl.capabilities import Replay, has
from alignflow.flows.stages.rl.rollout import Batch, Samples


class ReplayBuffer:
    """Each entry: the step that generated a group, its samples, and each row's behaviour log-probs
    (pi_old on its completion tokens, as trained on at that step)."""

    def __init__(self, algo, prompts_per_step: int, seed: int, state: list[dict] | None = None, where: str = ""):
        self.algo, self.seed = algo, seed
        # groups generated per step
        self.fresh = algo.fresh_groups(prompts_per_step) if has(algo, Replay) else prompts_per_step
        self.replayed = prompts_per_step - self.fresh  # groups replayed per step, once the buffer holds them
        if not 1 <= self.fresh <= prompts_per_step:
            raise ValueError(f"{type(algo).__name__}.fresh_groups({prompts_per_step}) = {self.fresh}: "
                             f"expected 1 to {prompts_per_step}")
        world = rank_and_world()[1]
        if self.fresh < world:
            raise SpecError(f"{where}settings.prompts_per_step: {self.fresh} fresh prompts a step (the rest are "
                            f"replayed) cannot be shared by {world} processes: at least one each")
        self.keep = algo.buffer_steps if self.replayed else 0  # nothing is kept when nothing is replayed
        self.entries: list[dict] = [
            {"step": e["step"], "samples": Samples(**e["samples"]), "behaviour": e["behaviour"]} for e in state or []
        ]

    def draw(self, step: int) -> list[dict]:
        """The entries to replay at `step`, as `algo.replay_groups` picks them among those young enough."""
        live = [e for e in self.entries if step - e["step"] <= self.keep]
        if not live or not self.replayed:
            return []
        ages = torch.tensor([step - e["step"] for e in live])
        generator = seeds.generator(seeds.replay(self.seed, step))
        picked = self.algo.replay_groups(ages, min(self.replayed, len(live)), generator)
        return [live[i] for i in picked.tolist()]

    def add(self, step: int, fresh: Samples, rollout: Rollout) -> None:
        """Keep `step`'s fresh groups (the first len(fresh) rows of the trained `rollout`) with the old
        log-probs they were trained on; forget the groups too old for the next step."""
        self.entries = [e for e in self.entries if step + 1 - e["step"] <= self.keep]
        if not self.keep or not len(fresh):
            return
        mask = rollout.response_mask[: len(fresh)].bool().cpu()
        old = rollout.old_logprobs[: len(fresh)].float().cpu()
        behaviour = [old[i][mask[i]].tolist() for i in range(len(fresh))]
        for group in sorted(set(fresh.group)):
            rows = [i for i, g in enumerate(fresh.group) if g == group]
            samples = replace(fresh.take(rows), counts={})  # counts are the round's, reported when it was fresh
            self.entries.append({"step": step, "samples": samples, "behaviour": [behaviour[i] for i in rows]})

    def state(self) -> list[dict]:
        """The entries as plain lists and dicts, for a checkpoint."""
        return [{"step": e["step"], "samples": asdict(e["samples"]), "behaviour": e["behaviour"]}
                for e in self.entries]


def with_replayed(fresh: Samples, picked: list[dict]) -> Samples:
    """The fresh samples, then the picked groups renumbered after the fresh groups (no id is shared)."""
    if not picked:
        return fresh
    base = max(fresh.group, default=-1) + 1
    groups = [replace(e["samples"], group=[base + j] * len(e["samples"])) for j, e in enumerate(picked)]
    return Samples.join([fresh, *groups])


def restore(batch: Batch, n_fresh: int, picked: list[dict]) -> Batch:
    """The batch with the old log-probs of each replayed row (rows n_fresh and on) set back to those it was
    trained on when fresh, whatever this step computed for them."""
    if not picked:
        return batch
    old, mask = batch.rollout.old_logprobs.clone(), batch.rollout.response_mask.bool()
    rows = [lp for e in picked for lp in e["behaviour"]]
    for i, lp in enumerate(rows, start=n_fresh):
        old[i, mask[i]] = torch.tensor(lp, dtype=old.dtype, device=old.device)
    return replace(batch, rollout=replace(batch.rollout, old_logprobs=old))


def replay_metrics(step: int, picked: list[dict], fresh: Samples) -> dict[str, float]:
    """The share of the batch's groups that are replayed, and their mean age in steps (fresh groups: 0)."""
    n = len(set(fresh.group)) + len(picked)
    ages = sum(step - e["step"] for e in picked)
    return {"rollout/replay_frac": len(picked) / max(n, 1), "rollout/staleness_mean": ages / max(n, 1)}
