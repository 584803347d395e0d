"""Sampler on transformers' `generate`: batched, KV-cached, left-padded, sharing the policy's weights."""

from __future__ import annotations

import time

import torch
from pydantic import Field

from alignflow.core import PluginConfig, Sampler, hookimpl
from alignflow.core.sampling import Generation, cut_at_stop, left_pad
from alignflow.core.settings import GenerationSettings


class HFSampler(Sampler):
    """transformers `generate` sampler (CPU or one GPU); holds the policy module itself, never a copy."""

    class Config(PluginConfig):
        batch_size: int = Field(64, ge=1)  # sequences (prompts x n) per generate call
        return_logprobs: bool = True

    online = True

    def load(self, model, tokenizer) -> None:
        """Bind the policy (an nn.Module, shared with the trainer) and its tokenizer."""
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id}

    def update_weights(self, model) -> None:
        """On CPU the trainer updates the very module we generate with: nothing to copy."""
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, gen: GenerationSettings, seed: int) -> Generation:
        """`n` completions per prompt; log-probs are of the temperature-scaled distribution."""
        start = time.perf_counter()
        rows = [ids for ids in prompt_ids for _ in range(n)]
        index = [i for i in range(len(prompt_ids)) for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        completions, truncated, logprobs = [], [], []
        try:
            for lo in range(0, len(rows), self.config.batch_size):
                c, t, lp = self._batch(rows[lo: lo + self.config.batch_size], gen)
                completions += c
                truncated += t
                logprobs += lp
        finally:
            torch.random.set_rng_state(generator_state)
            self.model.train(was_training)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Generation(index, completions, texts, truncated,
                          logprobs if self.config.return_logprobs else None,
                          {"generate_s": time.perf_counter() - start})

    def _batch(self, rows: list[list[int]], gen: GenerationSettings):
        ids, mask = left_pad(rows, self.pad_id)
        ids, mask = ids.to(self.model.device), mask.to(self.model.device)
        sample = gen.temperature > 0
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=gen.max_new_tokens, do_sample=sample,
            temperature=gen.temperature if sample else None, top_p=gen.top_p if sample else None, top_k=0 if sample else None,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.stop_ids), use_cache=True,
            return_dict_in_generate=True, output_logits=self.config.return_logprobs,
        )
        new = out.sequences[:, ids.shape[1]:].cpu()
        completions, truncated = cut_at_stop(new, self.stop_ids)
        logprobs = [[] for _ in completions]
        if self.config.return_logprobs and out.logits:
            logits = torch.stack(out.logits, 1).float().cpu() / (gen.temperature if sample else 1.0)
            lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            logprobs = [lp[i, : len(c)].tolist() for i, c in enumerate(completions)]
        return completions, truncated, logprobs


@hookimpl
def register_samplers(register):
    register("hf", HFSampler)
