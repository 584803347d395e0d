"""prm reward: a process reward model's step scores, aggregated into one reward per completion."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl

AGGREGATIONS = {
    "min": min,  # Math-Shepherd, PQM: a solution is as good as its worst step
    "prod": math.prod,  # the chance that every step is right
    "last": lambda p: p[-1],
    "mean": lambda p: sum(p) / len(p),
}


class ProcessReward:
    """Scores each step of a completion with a `prm` stage's model, P(step correct), and aggregates.

    The completion is split into steps at `step_separator` (default: the one the model was trained
    with, from its config) and scored as the `prm` stage trained it: the prompt, then each step followed
    by the separator, the score read at each separator. A completion with no step scores 0. Text past
    `max_length` tokens is cut from the left; steps whose end falls off are not scored.
    """

    class Config(PluginConfig):
        path: str = Field(description="a `prm` stage's model folder: model and tokenizer")
        # a solution's score from its steps': the worst (Math-Shepherd), product, last or mean
        aggregation: Literal["min", "prod", "last", "mean"] = "min"
        step_separator: str | None = Field(None, min_length=1, description="default: the model's own")
        batch_size: int = Field(8, ge=1)  # completions scored per forward pass
        max_length: int = Field(2048, ge=8)  # tokens of prompt and completion scored
        device: str | None = Field(None, description="default: cuda when available, else cpu")

    def __init__(self, config: Config):
        import torch

        from alignflow.core.train.models import load_tokenizer, load_value_model

        self.config = config
        self.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(config.path)
        self.model = load_value_model(config.path).to(self.device).eval()
        separator = config.step_separator or getattr(self.model.config, "step_separator", None)
        if separator is None:
            raise ValueError(f"{config.path}: the model records no step_separator (not a `prm` stage's "
                             f"model?); give the reward's step_separator")
        self.separator = separator
        self._last: tuple = (None, None)  # the last batch scored and its scores

    def step_scores(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        """P(step correct) for each step of each completion, `batch_size` completions at a time."""
        import torch

        from alignflow.core.train.batching import pad
        from alignflow.core.train.steps import split_steps, step_pieces, step_sequence
        from alignflow.core.train.models import token_values

        key = (prompts, completions)
        if key == self._last[0]:  # process-supervised RL asks for the rewards, then the steps, of one batch
            return self._last[1]
        seqs = []
        for p, c in zip(prompts, completions, strict=True):
            pieces = step_pieces(self.tokenizer, split_steps(c, self.separator), self.separator)
            ids, ends = step_sequence(self.tokenizer([p]).input_ids[0], pieces)
            cut = max(0, len(ids) - self.config.max_length)
            seqs.append((ids[cut:], [e - cut for e in ends if e >= cut]))
        out: list[list[float]] = []
        for lo in range(0, len(seqs), self.config.batch_size):
            chunk = seqs[lo: lo + self.config.batch_size]
            ids = pad([s[0] for s in chunk], self.tokenizer.pad_token_id).to(self.device)
            mask = pad([[1] * len(s[0]) for s in chunk], 0).to(self.device)
            with torch.inference_mode():
                probs = torch.sigmoid(token_values(self.model, ids, mask).float()).cpu()
            out += [probs[row, ends].tolist() for row, (_, ends) in enumerate(chunk)]
        self._last = ((list(prompts), list(completions)), out)
        return out

    def step_rewards(self, prompts: list[str], completions: list[str]) -> list[list[tuple[int, float]]]:
        """(where the step ends in the completion, in characters; P(step correct)) for each scored step."""
        from alignflow.core.train.steps import step_spans

        out = []
        for c, scores in zip(completions, self.step_scores(prompts, completions)):
            ends = [end for _, end in step_spans(c, self.separator)]
            out.append(list(zip(ends[len(ends) - len(scores):], scores)))  # truncation drops the first
        return out

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        aggregate = AGGREGATIONS[self.config.aggregation]
        return [aggregate(p) if p else 0.0 for p in self.step_scores(prompts, completions)]


@hookimpl
def register_rewards(register):
    register("prm", ProcessReward)
