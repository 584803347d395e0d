"""Implicit PRM (Yuan et al. 2024, "Free Process Rewards without Process Labels", arXiv 2412.01981).

An outcome reward parameterised as a log-likelihood ratio, r(y) = beta * log(pi(y) / pi_ref(y)) =
beta * sum_t log(pi(y_t | y_<t) / pi_ref(y_t | y_<t)), is trained on response-level labels only; its
partial sums q^t = beta * sum_{i <= t} log-ratio_i then give process rewards for free: step t's reward is
r^t = q^t - q^{t-1}, beta times the summed log-ratios of the step's tokens. `implicit_prm` the algorithm
trains such a model (a `preference` stage); `implicit_prm` the reward scores steps with it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import PairBatch, PreferenceAlgorithm, example_mean, reward_metrics

BETA = 0.05  # the paper's train/tasks/run_ce.sh


class ImplicitPRM(PreferenceAlgorithm):
    """The paper's cross-entropy objective on each response of a (correct, incorrect) pair.

    L = -[l log sigma(r) + (1 - l) log(1 - sigma(r))], r = beta * (log pi(y) - log pi_ref(y)) summed over
    the completion's tokens, l = 1 for the chosen (correct) response and 0 for the rejected one. A pair's
    loss is the mean of its two responses' (the official trainer averages over responses). Computed in
    logit form, log(1 - sigma(r)) = log sigma(-r), where `nn.BCELoss` on sigma(r) clamps the log at -100.
    Unlike DPO, each response's reward is pushed to its own side of 0, so sigma(r) estimates P(correct).
    The reference is the stage's `reference` input, else its initial model: the stage's manifest records
    which, and the `implicit_prm` reward reads it back from there.
    """

    class Config(PluginConfig):
        beta: float = Field(BETA, gt=0.0)  # the paper's 0.05 (run_ce.sh)

    requires_reference = True

    def implicit_rewards(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """r(y_w), r(y_l): beta times each response's summed log-ratio to the reference."""
        beta = self.config.beta
        return (beta * (batch.policy_chosen_logps - batch.ref_chosen_logps),
                beta * (batch.policy_rejected_logps - batch.ref_rejected_logps))

    def pair_losses(self, batch: PairBatch):
        chosen, rejected = self.implicit_rewards(batch)
        losses = -(F.logsigmoid(chosen) + F.logsigmoid(-rejected)) / 2  # l = 1, then l = 0
        return losses, chosen.detach(), rejected.detach()

    def loss(self, batch: PairBatch, norm: StepNorm | None = None):
        losses, chosen, rejected = self.pair_losses(batch)
        metrics = {"loss": losses.detach().mean(), **reward_metrics(chosen, rejected),
                   # responses the outcome classifier sigma(r) > 1/2 labels right
                   "ce/accuracy": ((chosen > 0).float() + (rejected < 0).float()).mean() / 2}
        return example_mean(losses, norm), metrics


# --- the reward ---------------------------------------------------------------------------------

def trained_with(path: str) -> tuple[str | None, float | None]:
    """(reference, beta) the `preference` stage that wrote the model folder `path` recorded, or Nones.

    The stage's manifest (`<artifact>/manifest.json`, the model in `<artifact>/out/model`) lists its
    inputs: the reference is its `reference` input, else its initial `model` (the preference stage's
    default reference), and beta is its algorithm's. An input path that no longer exists (artifacts moved)
    is looked up as the upstream stage's artifact under the same artifacts root.
    """
    model = Path(path).resolve()
    folder = model.parent.parent
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None, None
    if manifest.get("kind") != "preference" or (folder / manifest["outputs"].get("model", "")).resolve() != model:
        return None, None
    beta = (manifest.get("config", {}).get("algorithm") or {}).get("config", {}).get("beta")
    entry = manifest["inputs"].get("reference") or manifest["inputs"]["model"]
    resolved, spec, digest = entry["resolved"], entry["spec"], str(entry.get("digest", ""))
    if not resolved.startswith("builtin:") and not Path(resolved).exists() and spec.startswith("stage:"):
        upstream = folder.parent.parent / spec[len("stage:"):] / digest[len("stage:"):]
        with contextlib.suppress(OSError, ValueError, KeyError):  # not there either: say which path failed
            resolved = str(upstream / json.loads((upstream / "manifest.json").read_text())["outputs"]["model"])
    return resolved, beta


def load_causal_lm(src: str):
    """A frozen causal LM from a folder, a hub id, or `builtin:tiny` (rebuilt: same seed, same weights)."""
    from alignflow.core.train.models import build_tiny, load_model

    if src == "builtin:tiny":
        with tempfile.TemporaryDirectory() as tmp:
            return load_model(build_tiny(Path(tmp), seed=0)).eval().requires_grad_(False)
    return load_model(src).eval().requires_grad_(False)


@dataclass
class Scoring:
    """One completion as the reward scores it: prompt + completion (+ EOS) ids cut to `max_length`."""

    ids: list[int]
    start: int  # position of the completion's first token in `ids` (negative: that many were cut)
    ends: list[int]  # each step's last completion token; the last step runs to the end (EOS included)
    char_ends: list[int]  # where each step ends in the completion text


class ImplicitProcessReward:
    """Step rewards of an implicit PRM: beta times the summed log-ratio to its reference of each step's tokens.

    The completion is split into steps at `step_separator` (as the `prm` reward splits it) and scored as
    the preference stage trained the model: the prompt's ids, then the completion's ids and EOS. A step
    owns its tokens up to the token that completes its text (the separator before it included); the last
    step also owns what follows it (a trailing separator, EOS), so the step rewards add up to the outcome
    reward r(y). A completion with no step is one step. The outcome score is the minimum step reward
    (`min`, the paper's best-of-N rule) or their sum (`sum`: r(y) itself). The text is tokenised afresh,
    as in training, not read from a sampler's ids. Text past `max_length` tokens is cut from the left;
    steps that end in the cut part are not scored. Both models run without gradients, batch by batch.
    """

    class Config(PluginConfig):
        path: str = Field(description="the implicit PRM: a `preference` stage's model folder")
        reference: str | None = Field(None, description="the model it was trained against (folder, hub id or "
                                      "builtin:tiny); default: the one its stage recorded")
        beta: float | None = Field(None, gt=0.0, description="default: the beta its stage trained with, else 0.05")
        # a solution's score from its steps' rewards: the worst step, or their sum
        aggregation: Literal["min", "sum"] = "min"
        step_separator: str = Field("\n\n", min_length=1)  # the paper's evaluation joins steps by a blank line
        batch_size: int = Field(8, ge=1)  # completions scored per forward pass
        max_length: int = Field(2048, ge=8)  # tokens of prompt and completion scored
        device: str | None = Field(None, description="default: cuda when available, else cpu")

    def __init__(self, config: Config):
        from alignflow.core.train.models import load_tokenizer

        self.config = config
        recorded, trained_beta = trained_with(config.path)
        reference = config.reference or recorded
        if reference is None:
            raise ValueError(f"{config.path}: no preference stage's manifest records the reference this model "
                             f"was trained against; give the reward's `reference`")
        self.beta = config.beta or trained_beta or BETA
        self.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(config.path)
        self.model = load_causal_lm(config.path).to(self.device)
        try:
            self.reference = load_causal_lm(reference).to(self.device)
        except OSError as exc:
            if config.reference:
                raise
            raise ValueError(f"{config.path}: the reference its stage recorded, {reference}, does not load "
                             f"({exc}); give the reward's `reference`") from exc
        if self.model.config.vocab_size != self.reference.config.vocab_size:
            raise ValueError(f"{config.path} and its reference {reference} have different vocabularies "
                             f"({self.model.config.vocab_size} and {self.reference.config.vocab_size} tokens)")
        self._last: tuple = (None, None)  # the last batch scored and its step rewards

    def scoring(self, prompt: str, completion: str) -> Scoring:
        """The ids of one completion, where its steps end, cut from the left to `max_length`."""
        from alignflow.core.train.steps import step_spans, token_ends

        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        spans = step_spans(completion, self.config.step_separator) or [(completion, len(completion))]
        char_ends = [end for _, end in spans]
        text = tok(completion, add_special_tokens=False).input_ids
        ids = text + [eos] if eos is not None and (not text or text[-1] != eos) else text  # as in training
        decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
        ends = token_ends(decode, text, char_ends[:-1]) + [len(ids) - 1]
        ends = [max(ends[: j + 1]) for j in range(len(ends))]  # a token may complete two steps
        seq = tok(prompt).input_ids + ids
        cut = max(0, len(seq) - self.config.max_length)
        return Scoring(seq[cut:], len(seq) - len(ids) - cut, ends, char_ends)

    @torch.inference_mode()
    def log_ratios(self, chunk: list[Scoring]) -> torch.Tensor:
        """log pi(y_t | .) - log pi_ref(y_t | .) at each completion token of the chunk [B, T], 0 elsewhere."""
        from alignflow.core.train.batching import pad
        from alignflow.core.train.models import token_logprobs

        ids = pad([s.ids for s in chunk], self.tokenizer.pad_token_id).to(self.device)
        attention = pad([[1] * len(s.ids) for s in chunk], 0).to(self.device)
        scored = pad([[0] * max(s.start, 0) + [1] * (len(s.ids) - max(s.start, 0)) for s in chunk], 0)
        scored = scored.to(self.device)
        policy = token_logprobs(self.model, ids, attention, scored)
        return (policy - token_logprobs(self.reference, ids, attention, scored)).double().cpu()

    def steps_of(self, s: Scoring, ratios: torch.Tensor) -> list[tuple[int, float]]:
        """(char end, beta * the summed log-ratios of the step's tokens) of each step still in the text."""
        cut = max(0, -s.start)  # completion tokens cut from the left
        per_token = torch.zeros(len(s.ids) - s.start, dtype=torch.float64)
        per_token[cut:] = ratios[max(s.start, 0): len(s.ids)]
        q = torch.cat([per_token.new_zeros(1), per_token.cumsum(0)])[[e + 1 for e in s.ends]]  # q^t
        steps = self.beta * torch.diff(q, prepend=q.new_zeros(1))  # r^t = q^t - q^(t-1)
        return [(c, r) for c, e, r in zip(s.char_ends, s.ends, steps.tolist()) if e >= cut]

    def scored_steps(self, prompts: list[str], completions: list[str]) -> list[list[tuple[int, float]]]:
        """Each completion's scored steps, both models run on `batch_size` completions at a time."""
        key = (list(prompts), list(completions))
        if key == self._last[0]:  # process-supervised RL asks for the rewards, then the steps, of one batch
            return self._last[1]
        seqs = [self.scoring(p, c) for p, c in zip(prompts, completions, strict=True)]
        out = []
        for lo in range(0, len(seqs), self.config.batch_size):
            chunk = seqs[lo: lo + self.config.batch_size]
            ratios = self.log_ratios(chunk)
            out += [self.steps_of(s, ratios[row]) for row, s in enumerate(chunk)]
        self._last = (key, out)
        return out

    def step_rewards(self, prompts: list[str], completions: list[str]) -> list[list[tuple[int, float]]]:
        """(where the step ends in the completion, in characters; the step's reward) for each scored step."""
        return self.scored_steps(prompts, completions)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        aggregate = min if self.config.aggregation == "min" else sum
        return [aggregate(r for _, r in steps) for steps in self.scored_steps(prompts, completions)]


@hookimpl
def register_algorithms(register):
    register("implicit_prm", ImplicitPRM)


@hookimpl
def register_rewards(register):
    register("implicit_prm", ImplicitProcessReward)
