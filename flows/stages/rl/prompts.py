"""Which dataset rows an `rl` step generates for: seeded epochs, or Kimi k1.5's prioritised draw.

`epochs` walks a fresh seeded permutation per pass over the rows: every prompt once per pass.
`prioritized` draws each round's prompts without replacement with probability proportional to 1 - s_i,
s_i the success rate of prompt i so far in the stage (Kimi Team 2025, "Kimi k1.5", arXiv 2501.12599,
section 2.3.4): a curriculum that keeps returning to what the policy still fails. s_i is the share of all
completions generated for prompt i in this stage that were correct; an unseen prompt counts as unsolved.
Both draws are functions of the step and the success table, and the table is saved with every
checkpoint, so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import torch

from alignflow.core import seeds
from alignflow.flows.stages.rl.rollout import round_prompts

# Added to every weight: prompts always solved (1 - s_i = 0) stay drawable, rarely, so a round that needs
# more prompts than remain unsolved can still be filled.
SOLVED_WEIGHT = 1e-6


class PromptDraw:
    """The prompts of each step's generation rounds, and the success table the prioritised draw reads."""

    def __init__(self, n_rows: int, per_step: int, seed: int, mode: str = "epochs", state: dict | None = None):
        self.n_rows, self.per_step, self.seed, self.mode = n_rows, per_step, seed, mode
        self.held: dict[tuple[int, int], list[int]] = {}  # rounds drawn ahead of their step (`rows(keep=True)`)
        self.hits = torch.zeros(n_rows, dtype=torch.float64)  # correct completions per prompt
        self.trials = torch.zeros(n_rows, dtype=torch.float64)  # completions per prompt
        if state is not None:  # a resumed run: the table of the checkpoint's step
            self.hits, self.trials = state["hits"].clone(), state["trials"].clone()

    def success(self) -> torch.Tensor:
        """[n_rows] s_i: the share of prompt i's completions that were correct (0 for unseen prompts)."""
        return self.hits / self.trials.clamp(min=1)

    def weights(self) -> torch.Tensor:
        """[n_rows] unnormalised draw probabilities of the prioritised draw: 1 - s_i."""
        return (1 - self.success()).clamp(min=0) + SOLVED_WEIGHT

    def rows(self, step: int, round_: int, keep: bool = False) -> list[int]:
        """The `per_step` dataset rows of `step`'s generation round `round_`. A round drawn with `keep` (by the
        asynchronous rollouts, k steps ahead) is the one the step's own call gets, on the table of then."""
        if self.mode == "epochs":
            return round_prompts(step, round_, self.n_rows, self.per_step, self.seed)
        if (step, round_) in self.held:
            return self.held.pop((step, round_))
        generator = seeds.generator(seeds.priority(self.seed, step, round_))
        rows = torch.multinomial(self.weights(), self.per_step, replacement=False, generator=generator).tolist()
        if keep:
            self.held[(step, round_)] = rows
        return rows

    def record(self, rows: list[int], correct: list[bool]) -> None:
        """Count freshly generated completions (`rows[j]`: the dataset row of completion j)."""
        for row, ok in zip(rows, correct):
            self.hits[row] += float(ok)
            self.trials[row] += 1.0

    def metrics(self) -> dict[str, float]:
        """How much of the dataset the stage has tried, and the mean tracked success rate of what it tried."""
        seen = self.trials > 0
        mean = self.success()[seen].mean().item() if seen.any() else 0.0
        return {"sampling/prompts_seen": seen.double().mean().item(), "sampling/success_tracked": mean}

    def state(self) -> dict:
        return {"hits": self.hits.clone(), "trials": self.trials.clone()}
