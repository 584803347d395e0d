"""What a sampler returns, and the pieces every sampler shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Generation:
    """`n` completions for each of P prompts, flattened prompt-major: row i belongs to prompt i // n."""

    prompt_index: list[int]
    completion_ids: list[list[int]]  # generated tokens, the stop token included, no padding
    texts: list[str]  # decoded completions, special tokens removed
    truncated: list[bool]  # hit max_new_tokens before a stop token
    logprobs: list[list[float]] | None = None  # sampling log-probs per generated token, when known
    timings: dict[str, float] = field(default_factory=dict)
    # Multi-turn episodes (core/environments): each row's own prompt ids (what the environment started it
    # with), 1 on the model's tokens of the completion and 0 on the environment's, and per-episode records
    # (reward, turns, tool_calls, tool_errors, ended), and the JSON schemas of the tools the batch's episodes
    # were shown, once: alike in every episode. None for single-turn completions.
    prompt_ids: list[list[int]] | None = None
    loss_mask: list[list[int]] | None = None
    episodes: dict[str, list] | None = None
    tools: list[dict] | None = None
    # The policy version (updates published) that sampled each token, where a generation switched weights
    # mid-way (asynchronous rollouts' `partial`); None: every token of a row by the weights it started on.
    versions: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.completion_ids]

    @classmethod
    def concat(cls, parts: list[tuple[int, "Generation"]]) -> "Generation":
        """Join generations of consecutive prompt chunks, each given with its first prompt's index."""
        logprobs = None if any(g.logprobs is None for _, g in parts) else [lp for _, g in parts for lp in g.logprobs]
        timings: dict[str, float] = {}
        for _, g in parts:
            for k, v in g.timings.items():
                timings[k] = timings.get(k, 0.0) + v
        def joined(name):
            return None if any(getattr(g, name) is None for _, g in parts) else [
                x for _, g in parts for x in getattr(g, name)]

        episodes = None if not parts or any(g.episodes is None for _, g in parts) else {
            k: [x for _, g in parts for x in g.episodes[k]] for k in parts[0][1].episodes}
        return cls([lo + i for lo, g in parts for i in g.prompt_index],
                   [c for _, g in parts for c in g.completion_ids], [t for _, g in parts for t in g.texts],
                   [t for _, g in parts for t in g.truncated], logprobs, timings,
                   joined("prompt_ids"), joined("loss_mask"), episodes,
                   next((g.tools for _, g in parts if g.tools is not None), None), joined("versions"))


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows to the longest one: (input_ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def cut_at_stop(tokens: torch.Tensor, stop_ids: set[int]) -> tuple[list[list[int]], list[bool]]:
    """Trim generated rows after their first stop token (kept); rows with none are truncated."""
    rows, truncated = [], []
    is_stop = torch.zeros_like(tokens, dtype=torch.bool)
    for sid in stop_ids:
        is_stop |= tokens == sid
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1), torch.full_like(tokens[:, 0], -1))
    for row, stop in zip(tokens.tolist(), first.tolist()):
        if stop >= 0:
            rows.append(row[: stop + 1])
            truncated.append(False)
        else:  # generate pads only after a stop token, so an unfinished row is all real tokens
            rows.append(row)
            truncated.append(True)
    return rows, truncated
