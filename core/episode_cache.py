"""Each multi-turn episode's KV cache, kept between its turns so a turn prefills only the tokens that are new.

An episode's next prompt is its last prompt, the tokens sampled for it, and the environment's reply. After a turn
the packed decoder (`alignflow.core.train.decoder`) holds the keys and values of the first two; kept under the episode's
key, the next turn reuses them for the longest prefix they share with its prompt (all of them, unless a chat
template rendered earlier tokens differently: then up to the first token that differs, and none when the first
does: a full prefill) and computes only the rest. Attention is causal, so a prefix's keys and values depend on that
prefix alone: reusing them changes the logits by float rounding only (the same tokens computed in ops of other
shapes), never which tokens they are of.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Hashable

from torch import Tensor


@dataclass
class Kept:
    """The keys and values of an episode's first `len(tokens)` tokens, per layer [kv_heads, len(tokens), head_dim]."""

    tokens: list[int]
    keys: list[Tensor]
    values: list[Tensor]

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, length: int) -> "Kept":
        """The first `length` tokens' keys and values (views: no copy)."""
        return Kept(self.tokens[:length], [k[:, :length] for k in self.keys], [v[:, :length] for v in self.values])


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # an episode's next turn: all of the shorter one (one comparison in C)
        return n
    return next(i for i in range(n) if a[i] != b[i])


class EpisodeCaches:
    """Episode key -> what its last turn left in the decoder's cache; and the sampler's prompt tokens since it was
    loaded: `prefilled` (computed) and `reused` (taken from an episode's cache instead)."""

    def __init__(self):
        self.kept: dict[Hashable, Kept] = {}
        self.reused = 0
        self.prefilled = 0

    def past(self, key: Hashable, prompt: list[int]) -> Kept | None:
        """What can be reused of `key`'s cache for `prompt` (None: nothing, prefill it all). The entry is taken out:
        the turn about to be decoded leaves the episode's next one."""
        kept = self.kept.pop(key, None)
        if kept is None:
            return None
        # the prompt's last token is computed even when cached: its logits start the turn
        same = min(shared_prefix(kept.tokens, prompt), len(prompt) - 1)
        return kept.prefix(same) if same > 0 else None

    def count(self, prompts: list[list[int]], past: list[Kept | None]) -> None:
        """Note a prefill of `prompts` that reused `past`."""
        reused = sum(len(p) for p in past if p is not None)
        self.reused += reused
        self.prefilled += sum(map(len, prompts)) - reused

    def put(self, key: Hashable, kept: Kept) -> None:
        self.kept[key] = kept

    def free(self, keys) -> None:
        """Forget these episodes' caches (they ended)."""
        for key in keys:
            self.kept.pop(key, None)

    def clear(self) -> None:
        """Forget every cache (the weights they were computed with changed)."""
        self.kept.clear()


class Taken:
    """Each row's keys and values, taken out of a decoder before the row leaves its batch: the turn's cache of its
    episode. `prompts`: the rows' prompts, left-padded to `width` tokens in the decoder."""

    def __init__(self, decoder, prompts: list[list[int]], width: int):
        self.decoder, self.prompts, self.width = decoder, prompts, width
        self.rows: dict[int, tuple[list[Tensor], list[Tensor]]] = {}

    def take(self, batch_rows, here) -> None:
        """Copy out batch rows `batch_rows` (request rows `here[b]`): their prompt's and fed tokens' slots."""
        for b in batch_rows:
            r = int(here[b])
            self.rows[r] = self.decoder.row(int(b), self.width - len(self.prompts[r]))

    def store(self, caches: EpisodeCaches, keys: list[Hashable], completions: list[list[int]]) -> None:
        """Keep each row's cache under its episode's key: the prompt and the sampled tokens that were fed (the last
        one never is; a stopped row kept in the batch was fed tokens after its stop, which are not kept)."""
        for r, key in enumerate(keys):
            k, v = self.rows[r]
            tokens = self.prompts[r] + completions[r]
            caches.put(key, Kept(tokens, k, v).prefix(min(len(tokens), k[0].shape[1])))
