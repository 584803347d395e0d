"""ExPO: GRPO plus an SFT term on self-explanations of unsolved prompts (Zhou et al., arXiv 2507.02834)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from pydantic import Field, field_validator
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import PolicyBatch, Rollout, broadcast
from alignflow.core.rl.capabilities import GuidedSamples
from alignflow.core.rl.parts import group_normalize, masked_mean
from alignflow.plugins.grpo import GRPO, GRPOConfig


class ExPOConfig(GRPOConfig):
    # beta of the ExP-SFT term; 0.04 is the best of the paper's beta ablation (0.5 does worse than plain GRPO).
    # The paper proposes annealing beta but, as far as its text could be read, gives no schedule: constant here.
    sft_coef: float = Field(0.04, ge=0.0)
    guided_samples: int = Field(4, ge=1)  # self-explanations drawn per unsolved group (the paper's count: not found)
    # The hint: the bundled task's answer tags, then its prompt, so that the completion starts right after "="
    # as in every training example. For a chat model, write the paper's kind of request instead, e.g.
    # "{prompt}\nThe correct answer is {answer}. Explain the reasoning that leads to it."
    hint_template: str = "<answer>{answer}</answer>{prompt}"

    @field_validator("hint_template")
    @classmethod
    def _fields(cls, v: str) -> str:
        try:
            shown = v.format(prompt="", answer="\0")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"fields allowed: {{prompt}} and {{answer}} (double a literal brace); got {e!r}") from e
        if "\0" not in shown:
            raise ValueError("must show the answer: put {answer} in it")
        return v


class ExPO(GuidedSamples, GRPO):
    """ExP-GRPO (Zhou, Li, Zhang, Leqi, "ExPO: Unlocking Hard Reasoning with Self-Explanation-Guided
    Reinforcement Learning", arXiv 2507.02834): J = J_GRPO + beta * log pi_theta(c~, a* | q), c~ ~ pi_theta(. | q, a*).

    For each group whose G completions are all wrong (GRPO's advantages are all 0 there), the stage samples
    `guided_samples` self-explanations after `hint_template` (the question with the reference answer a*) and
    keeps those the verifier accepts; each ends in a*, so it is (c~, a*). They join the rollout as extra rows
    flagged `Rollout.guided`, in the group of their prompt but outside its baseline, as in the paper, where
    they are no member of the G samples and get no advantage. Their tokens sit after the PLAIN prompt q, so
    the trainer's forward gives log pi_theta(c~, a* | q) (the answer is hidden at training time), and their
    per-token loss is the ExP-SFT term alone, -sft_coef * log pi_theta: no ratio (they were sampled after
    another prompt, so a ratio to the sampler's log-probs would compare two distributions) and no KL. Their
    old log-probs, which no term reads but the stage's metrics and `tis_cap` do, are a no-grad forward of the
    policy on plain prompt + completion before the update, not the sampler's. As every log-prob of the stage,
    the NLL is of logits / the sampling temperature. Ordinary rows get GRPO's clipped surrogate and KL. The
    stage's aggregation makes the SFT term the usual
    length-normalised NLL: under seq-mean-token-mean each guided row is one sequence of the step, weighted by
    its mean token NLL (the paper writes a sequence log-likelihood; its code was not available here).
    Deviations: only unsolved groups get self-explanations (the paper's objective has the term for every
    question) and every accepted one is kept.
    """

    Config: ClassVar[type[ExPOConfig]] = ExPOConfig

    def guided_prompt(self, prompt: str, answer: str) -> str | None:
        return self.config.hint_template.format(prompt=prompt, answer=answer)

    @property
    def guided_samples(self) -> int:
        return self.config.guided_samples

    def advantages(self, rollout: Rollout):
        if rollout.guided is None or not rollout.guided.any():
            return super().advantages(rollout)
        plain = ~rollout.guided
        scores = torch.zeros_like(rollout.rewards, dtype=torch.float32)
        scores[plain] = group_normalize(rollout.rewards[plain], rollout.group[plain], scale=self.config.scale_rewards)
        return broadcast(scores, rollout.response_mask), None

    def inert_rows(self, rollout: Rollout, advantages: Tensor) -> Tensor | None:
        inert = super().inert_rows(rollout, advantages)
        if inert is None or rollout.guided is None:
            return inert
        return inert & ~rollout.guided  # a guided row's loss is its SFT term, whatever its advantage

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if batch.guided is None or not batch.guided.any():
            return super().loss(batch)
        guided = batch.guided[:, None]
        # GRPO's per-token loss does not read the mask; its metrics then count the ordinary rows only.
        loss, metrics = super().loss(replace(batch, response_mask=batch.response_mask * ~guided))
        if batch.guided.all():  # no ordinary row: its ratio and clip metrics would read 0 and drag the step's mean
            metrics = {}
        nll = -batch.logprobs
        loss = torch.where(guided, self.config.sft_coef * nll, loss)
        metrics["expo/sft_nll"] = masked_mean(nll, batch.response_mask * guided).detach()
        return loss, metrics


@hookimpl
def register_algorithms(register):
    register("expo", ExPO)
