"""genrm reward: a generative verifier's P("Yes") that a solution is correct (Zhang et al. 2024, arXiv 2408.15240)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from alignflow.core import hookimpl
from alignflow.plugins.genrm_examples import VerdictConfig


class GenerativeVerifier:
    """Scores a completion by a causal LM trained to verify (an `sft` stage on `genrm_examples` rows): the problem
    and the completion fill `template`, and the score is P(yes) / (P(yes) + P(no)) at the verdict position.

    The two verdict texts are compared at their first differing token (" Yes"/" No" share the space in a
    character tokenizer): the softmax over those two tokens' logits after their common prefix.
    `mode: direct` reads it after the question (one forward pass); `mode: cot` (GenRM-CoT) samples `votes`
    rationales at `temperature`, reads the verdict after each (a rationale ends where the model first writes
    a verdict, or where it stops) and averages: the paper's majority voting over verifications. Text past
    `max_length` tokens is cut from the left.
    """

    class Config(VerdictConfig):  # template, yes, no: as the verifier's rows had them
        path: str = Field(description="the verifier: a causal LM checkpoint folder (model and tokenizer)")
        # direct: the verdict after the question; cot: after each of `votes` sampled rationales
        mode: Literal["direct", "cot"] = "direct"
        votes: int = Field(4, ge=1, description="cot: rationales sampled per completion, their verdicts averaged")
        temperature: float = Field(1.0, gt=0)  # cot: of the sampled rationales
        max_new_tokens: int = Field(64, ge=1, description="cot: the longest rationale")
        seed: int = 0  # cot: the sampling seed (the global RNG is left as it was)
        batch_size: int = Field(8, ge=1)  # completions scored per forward pass
        max_length: int = Field(256, ge=8)  # tokens of prompt and completion; longer text is cut from the left
        device: str | None = Field(None, description="default: cuda when available, else cpu")

    def __init__(self, config: Config):
        import torch

        from alignflow.core.train.models import load_model, load_tokenizer

        self.config = config
        self.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(config.path)
        self.model = load_model(config.path).to(self.device).eval()
        self.prefix, self.yes_id, self.no_id = verdict_tokens(self.tokenizer, config.yes, config.no)

    def contexts(self, prompts: list[str], completions: list[str]) -> list[list[int]]:
        """The verification prompt's ids for each (prompt, completion), tokenized as the `sft` stage did."""
        texts = [self.config.template.format(prompt=p, completion=c) for p, c in zip(prompts, completions, strict=True)]
        return self.tokenizer(texts).input_ids

    def verdicts(self, seqs: list[list[int]]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) after each sequence and the verdicts' common prefix, batched."""
        import torch

        from alignflow.core.train.batching import pad

        out: list[float] = []
        for lo in range(0, len(seqs), self.config.batch_size):
            chunk = [(s + self.prefix)[-self.config.max_length:] for s in seqs[lo: lo + self.config.batch_size]]
            ids = pad(chunk, self.tokenizer.pad_token_id, side="left").to(self.device)
            mask = pad([[1] * len(s) for s in chunk], 0, side="left").to(self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding does not shift positions
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            two = logits[:, [self.yes_id, self.no_id]].float()
            out += torch.softmax(two, dim=-1)[:, 0].tolist()
        return out

    def rationales(self, contexts: list[list[int]]) -> list[list[int]]:
        """`votes` sampled rationales per context, in order (context 0's first), each cut before its verdict."""
        import torch

        from alignflow.core.train.batching import pad

        c = self.config
        keep = max(1, c.max_length - c.max_new_tokens - len(self.prefix) - 1)
        repeated = [ctx[-keep:] for ctx in contexts for _ in range(c.votes)]
        stops = {self.tokenizer.pad_token_id, self.tokenizer.eos_token_id}
        out: list[list[int]] = []
        with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else []):
            torch.manual_seed(c.seed)
            for lo in range(0, len(repeated), c.batch_size):
                chunk = repeated[lo: lo + c.batch_size]
                ids = pad(chunk, self.tokenizer.pad_token_id, side="left").to(self.device)
                mask = pad([[1] * len(s) for s in chunk], 0, side="left").to(self.device)
                with torch.inference_mode():
                    new = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                              temperature=c.temperature, top_k=0, top_p=1.0,
                                              max_new_tokens=c.max_new_tokens,
                                              pad_token_id=self.tokenizer.pad_token_id)[:, ids.shape[1]:]
                out += [cut_rationale(row, self.prefix, (self.yes_id, self.no_id), stops) for row in new.tolist()]
        return out

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        contexts = self.contexts(prompts, completions)
        if self.config.mode == "direct":
            return self.verdicts(contexts)
        k = self.config.votes
        why = self.rationales(contexts)
        scores = self.verdicts([contexts[j // k] + r for j, r in enumerate(why)])
        return [sum(scores[i * k: (i + 1) * k]) / k for i in range(len(contexts))]


def verdict_tokens(tokenizer, yes: str, no: str) -> tuple[list[int], int, int]:
    """(the verdicts' common prefix ids, yes's first own token id, no's first own token id)."""
    y = tokenizer(yes, add_special_tokens=False).input_ids
    n = tokenizer(no, add_special_tokens=False).input_ids
    common = 0
    while common < min(len(y), len(n)) and y[common] == n[common]:
        common += 1
    if common == min(len(y), len(n)):
        raise ValueError(f"verdicts {yes!r} and {no!r}: one's tokens start the other's, no token tells them apart")
    return y[:common], y[common], n[common]


def cut_rationale(ids: list[int], prefix: list[int], verdicts: tuple[int, int], stops: set) -> list[int]:
    """`ids` up to where a verdict (`prefix` then one of `verdicts`) first starts, else up to the first stop
    token (EOS, padding), else all of it."""
    width = len(prefix) + 1
    for j in range(len(ids) - width + 1):
        if ids[j: j + len(prefix)] == prefix and ids[j + len(prefix)] in verdicts:
            return ids[:j]
    for j, t in enumerate(ids):
        if t in stops:
            return ids[:j]
    return ids


@hookimpl
def register_rewards(register):
    register("genrm", GenerativeVerifier)
