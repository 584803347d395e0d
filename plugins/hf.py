"""Sampler on the policy module itself: a KV-cached decode loop, no second engine.

One call decodes every row of a request (up to `max_batch_tokens`), rows that stopped leave the
batch (their KV cache rows are dropped), and each step's log-prob of the sampled token is taken as
it is drawn, so no `B x T x vocab` stack of logits is ever held.

Two forwards run the loop. `packed` (`alignflow.core.train.decoder`): Llama-family models rebuilt for
decoding (fused projections, a preallocated cache, each prompt prefilled once for its `n` samples),
in the trainer's compute precision (`dtype`: bf16 where the stage trains under bf16 autocast);
`transformers`: the model's own forward with a `DynamicCache` (`alignflow.core.forward_decoder`), for every
other model. `engine: auto` takes `packed` on a CPU when the model is one it rebuilds.

Multi-turn episodes (`continuing`): on either forward, each episode's KV cache stays between its turns, and a turn
prefills only what its last one did not leave in it (the sampled turn's stop token and the environment's reply;
`alignflow.core.episode_cache`), so an episode's prefill cost grows with its tokens, not with its turns squared.
Its caches are freed when the episode ends (`end_episodes`) or the weights change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from pydantic import Field

from alignflow.core import PluginConfig, Sampler, hookimpl
from alignflow.core.train.decoder import PackedDecoder, unsupported
from alignflow.core.episode_cache import EpisodeCaches, Taken
from alignflow.core.forward_decoder import ForwardDecoder
from alignflow.core.sampling import Generation, cut_at_stop, left_pad
from alignflow.core.spec.settings import GenerationSettings

log = logging.getLogger(__name__)
COMPACT_AT = 0.25  # drop stopped rows from the batch once they are this share of it
BATCH_STEP = 16  # a compacted batch keeps a multiple of this many rows (stopped ones fill it)


def compacted(running: torch.Tensor, alive: int) -> torch.Tensor:
    """The batch rows to keep: the running ones, and stopped ones up to a multiple of BATCH_STEP rows. Batch sizes
    then come from a short list: the CPU's matmul library (oneDNN) builds and keeps kernels for each matrix shape
    it meets (~0.5 MB each here), which grew a stage's memory by ~80 MB over 10 steps when every batch size could
    occur. A stopped row kept is decoded and never recorded. `alive`: how many rows run."""
    size = min(len(running), -(-alive // BATCH_STEP) * BATCH_STEP)
    stopped = (~running).nonzero().flatten()[: size - alive]
    return torch.cat([running.nonzero().flatten(), stopped]).sort().values


class HFSampler(Sampler):
    """Decode loop on transformers forwards (CPU or one GPU); holds the policy module itself, never a copy."""

    class Config(PluginConfig):
        batch_size: int | None = Field(None, ge=1)  # rows per decode loop (whole prompts of n); None: by max_batch_tokens
        max_batch_tokens: int = Field(1 << 18, ge=1)  # rows x (longest prompt + max_new_tokens) per loop
        return_logprobs: bool = True  # the sampled tokens' log-probs, which RL stages take as pi_old
        engine: Literal["auto", "packed", "transformers"] = "auto"  # auto: packed on a CPU where it can
        dtype: Literal["auto", "fp32", "bf16"] = "auto"  # packed only; auto: the training stage's precision
        # keep each multi-turn episode's KV cache between its turns and prefill only its new tokens; unset: where
        # decoding computes in fp32 (the ids of a full prefill, log-probs to float rounding), not in bf16 (whose
        # rounding can change a sampled token); false: prefill each turn's whole context
        episode_cache: bool | None = None

    online = True
    # Set by an asynchronous rollout worker (`async_weights: partial`): between decode steps, `due()` says newer
    # weights are published; the rows still running then stop, `refresh()` loads the weights, and they continue
    # from their tokens so far on them. Each token's version is then in `Generation.versions`.
    preempt = None

    def set_precision(self, precision: str) -> None:
        """`dtype: auto` decodes in bf16 where the trainer computes in bf16 (so in a rollout worker too)."""
        if self.config.dtype == "auto":
            self.config = self.config.model_copy(update={"dtype": "fp32" if precision == "fp32" else "bf16"})

    def load(self, model, tokenizer) -> None:
        """Bind the policy (an nn.Module, shared with the trainer) and its tokenizer."""
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id}
        self._said = False  # the fallback to transformers' forward is logged once
        self.caches = EpisodeCaches()
        self._episodes: list[Hashable] | None = None  # set by `continuing`: the episode of each prompt

    def update_weights(self, model) -> None:
        """On CPU the trainer updates the very module we generate with: nothing to copy. Kept episode caches were
        computed with the old weights: they go."""
        self.model = model
        self.caches.clear()

    @contextmanager
    def continuing(self, episodes: list[Hashable]) -> Iterator[None]:
        """The calls inside continue these episodes (one per prompt): their caches are reused and kept."""
        self._episodes = list(episodes)
        try:
            yield
        finally:
            self._episodes = None

    def end_episodes(self, episodes: list[Hashable]) -> None:
        """Free these episodes' caches."""
        self.caches.free(episodes)

    def rows_per_call(self, rows: list[list[int]], gen: GenerationSettings) -> int:
        if self.config.batch_size is not None:
            return self.config.batch_size
        width = max(map(len, rows)) + gen.max_new_tokens
        return max(1, self.config.max_batch_tokens // width)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, gen: GenerationSettings, seed: int) -> Generation:
        """`n` completions per prompt; log-probs are of the temperature-scaled distribution."""
        start = time.perf_counter()
        index = [i for i in range(len(prompt_ids)) for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        generator = torch.Generator(self.model.device).manual_seed(seed)
        completions, truncated, logprobs = [], [], []
        step = max(1, self.rows_per_call(prompt_ids, gen) // n)  # prompts per call
        if self.preempt is not None and self.preempt.due():  # a new call (an episode's next turn): newest weights
            self.preempt.refresh()
        packed, versions = self.packed(), []
        keys = self.episode_keys(packed, n, len(prompt_ids))
        try:
            for lo in range(0, len(prompt_ids), step):
                part = None if keys is None else keys[lo: lo + step]
                c, t, lp, cut = self.decode(prompt_ids[lo: lo + step], n, gen, generator, packed, part)
                v = [[self.preempt.version] * len(x) for x in c] if self.preempt is not None else []
                while cut:  # rows stopped for newer weights: on with them, from their tokens so far
                    packed, cut = self.resumed(prompt_ids[lo: lo + step], n, gen, generator, (c, t, lp, v), cut)
                completions, truncated, logprobs, versions = completions + c, truncated + t, logprobs + lp, versions + v
        finally:
            self.model.train(was_training)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Generation(index, completions, texts, truncated,
                          logprobs if self.config.return_logprobs else None,
                          {"generate_s": time.perf_counter() - start}, versions=versions or None)

    def resumed(self, prompts, n, gen, generator, out, cut: list[int]):
        """Load the newest weights and go on decoding the `cut` rows of `out` (completions, truncated,
        log-probs, versions: extended in place) from prompt + their tokens so far. Returns the decoder of the new
        weights and the rows stopped again."""
        c, t, lp, v = out
        version, packed = self.preempt.refresh(), self.packed()
        rest = gen.model_copy(update={"max_new_tokens": gen.max_new_tokens - len(c[cut[0]])})
        more = self.decode([prompts[r // n] + c[r] for r in cut], 1, rest, generator, packed)
        for j, r in enumerate(cut):
            c[r], t[r], lp[r] = c[r] + more[0][j], more[1][j], lp[r] + more[2][j]
            v[r] = v[r] + [version] * len(more[0][j])
        return packed, [cut[j] for j in more[3]]

    def episode_keys(self, packed: PackedDecoder | None, n: int, prompts: int) -> list[Hashable] | None:
        """Each prompt's episode where this call continues episodes whose caches are kept: one sample a prompt, no
        `preempt` (a turn there may start on newer weights than its cache was computed with), `episode_cache` on
        (unset: decoding in fp32), and on transformers' forward a model whose every layer caches every token (no
        sliding window)."""
        keys, c = self._episodes, self.config
        if keys is None or n != 1 or self.preempt is not None or c.episode_cache is False:
            return None
        dtype = packed.dtype if packed is not None else next(self.model.parameters()).dtype
        if c.episode_cache is None and dtype != torch.float32:
            return None
        if packed is None and not ForwardDecoder.keeps_rows(self.model):
            return None
        if len(keys) != prompts:
            raise ValueError(f"sampler hf: {len(keys)} episodes continued, but {prompts} prompts to generate for")
        return keys

    def packed(self) -> PackedDecoder | None:
        """The policy's current weights rebuilt for decoding, or None where transformers' forward runs."""
        c = self.config
        if c.engine == "transformers" or (c.engine == "auto" and self.model.device.type != "cpu"):
            return None
        why = unsupported(self.model)
        if why is not None:
            if c.engine == "packed":
                raise ValueError(f"sampler hf: engine packed cannot run this model: {why}")
            if not self._said:
                log.info("hf sampler: transformers' forward decodes (%s)", why)
                self._said = True
            return None
        return PackedDecoder(self.model, torch.bfloat16 if c.dtype == "bf16" else torch.float32)

    def decode(self, prompts: list[list[int]], n: int, gen: GenerationSettings, generator: torch.Generator,
               packed: PackedDecoder | None = None, episodes: list[Hashable] | None = None):
        """Prefill the left-padded prompts, then one forward per new token for the rows still running: each row's
        tokens (cut at its stop token), whether it hit max_new_tokens, its log-probs, and the rows a `preempt`
        stopped for newer weights (all at the same length). With `episodes` (n = 1), each prompt's episode:
        what its cache holds of the prompt is not prefilled again, and the cache is kept for its next turn."""
        device = self.model.device
        decoder = packed if packed is not None else ForwardDecoder(self.model)
        rows = prompts if packed is not None else [ids for ids in prompts for _ in range(n)]
        ids, mask = left_pad(rows, self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        B, T = len(prompts) * n, gen.max_new_tokens
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=device)
        chosen_lp = torch.zeros(B, T, dtype=torch.float32, device=device)
        stops = torch.tensor(sorted(self.stop_ids), device=device)
        here = torch.arange(B, device=device)  # batch row -> request row
        running = torch.ones(B, dtype=torch.bool, device=device)  # batch rows that have not stopped
        taken = None if episodes is None else Taken(decoder, rows, ids.shape[1])
        if taken is not None:
            logits = self.resumed_prefill(decoder, ids, mask, rows, episodes, ids.shape[1] + T)
        else:
            logits = decoder.start(ids, mask, n if packed is not None else 1, ids.shape[1] + T)
            self.caches.count(rows, [None] * len(rows))
        forward, keep = decoder.step, decoder.keep
        preempted: list[int] = []
        for t in range(T):
            token, lp = self.pick(logits.float(), gen, generator)
            tokens[here, t], chosen_lp[here, t] = token, lp  # a stopped row's later tokens: cut by cut_at_stop
            running &= ~torch.isin(token, stops)
            alive = int(running.sum())
            if alive == 0 or t == T - 1:
                break
            if self.preempt is not None and self.preempt.due():
                preempted = sorted(here[running].tolist())
                tokens = tokens[:, : t + 1]
                break
            if alive <= len(here) * (1 - COMPACT_AT) and len(rows_left := compacted(running, alive)) < len(here):
                if taken is not None:  # the rows leaving the batch: their caches, before they go
                    taken.take(leaving(rows_left, len(here)), here)
                keep(rows_left)
                here, running, token = here[rows_left], running[rows_left], token[rows_left]
            logits = forward(token)
        completions, truncated = cut_at_stop(tokens.cpu(), self.stop_ids)
        if taken is not None:
            taken.take(range(len(here)), here)
            taken.store(self.caches, episodes, completions)
        rows_lp = chosen_lp.tolist()  # one conversion, then list slices (a tensor slice per row cost ~3 us each)
        return completions, truncated, [lp[: len(c)] for lp, c in zip(rows_lp, completions)], preempted

    def resumed_prefill(self, decoder, ids, mask, prompts, episodes, width: int) -> torch.Tensor:
        """The next-token logits of `prompts` (left-padded `ids`/`mask`), each reusing what its episode's cache
        holds of it; a full prefill where none does (an episode's first turn)."""
        past = [self.caches.past(key, p) for key, p in zip(episodes, prompts)]
        self.caches.count(prompts, past)
        if all(p is None for p in past):
            return decoder.start(ids, mask, 1, width)
        return decoder.resume(ids, mask, past, width)

    @staticmethod
    def pick(logits: torch.Tensor, gen: GenerationSettings, generator: torch.Generator):
        """Next token per row (greedy, or sampled at `temperature` within `top_p`) and its log-prob under
        the temperature-scaled distribution (top-p only restricts which tokens can be drawn)."""
        if gen.temperature == 0:
            token = logits.argmax(-1)
            return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        logp = torch.log_softmax(logits if gen.temperature == 1 else logits / gen.temperature, -1)
        probs = logp.exp()
        if gen.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p >= gen.top_p  # the mass before a token already reaches top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        # Inverse-CDF draw: one uniform per row (torch.multinomial draws one exponential per vocabulary entry).
        cdf = probs.double().cumsum(-1)
        u = torch.rand(len(cdf), 1, generator=generator, device=cdf.device, dtype=torch.float64) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)


def leaving(rows_left: torch.Tensor, size: int) -> torch.Tensor:
    """The batch rows of `size` that are not in `rows_left`."""
    gone = torch.ones(size, dtype=torch.bool, device=rows_left.device)
    gone[rows_left] = False
    return gone.nonzero().flatten()


@hookimpl
def register_samplers(register):
    register("hf", HFSampler)
