"""judge reward: an LLM reads prompt, completion and reference, and writes a verdict that is parsed."""

from __future__ import annotations

import re
import string

from pydantic import Field, field_validator, model_validator

from alignflow.core import PluginConfig, hookimpl

TEMPLATE = (
    "Question: {prompt}\nReference answer: {answer}\nResponse: {completion}\n"
    "Is the response correct? End with 'VERDICT: yes' or 'VERDICT: no'.\n"
)
PLACEHOLDERS = {"prompt", "completion", "answer"}


def placeholders(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def last_score(pattern: re.Pattern, verdicts: dict[str, float] | None, text: str) -> float | None:
    """The score of the last match of `pattern` in `text`: its group 1 looked up in `verdicts` (lower-cased), or
    read as a number when `verdicts` is None; None if there is no match or it maps to nothing."""
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    value = matches[-1].group(1).strip()
    if verdicts is not None:
        return verdicts.get(value.lower())
    try:
        return float(value)
    except ValueError:
        return None


class Judge:
    """LLM-as-a-judge: greedy verdict from a causal LM, parsed by a regex; unparseable gives None."""

    class Config(PluginConfig):
        path: str = Field(description="causal LM checkpoint folder: model and tokenizer")
        template: str = Field(TEMPLATE, description="judge prompt with {prompt} {completion} {answer}")
        pattern: str = Field(r"VERDICT:\s*(yes|no)", description="regex; group 1 is the verdict")
        mapping: dict[str, float] | None = Field(
            default_factory=lambda: {"yes": 1.0, "no": 0.0},
            description="verdict -> score (case-insensitive); null: group 1 is a number")
        max_new_tokens: int = Field(64, ge=1)  # the longest judgement generated
        batch_size: int = Field(8, ge=1)  # completions judged per generate call
        device: str | None = None  # None: cuda when available, else cpu

        @field_validator("template")
        @classmethod
        def _known_placeholders(cls, v: str) -> str:
            names = placeholders(v)
            if names - PLACEHOLDERS:
                raise ValueError(
                    f"unknown placeholders {sorted(names - PLACEHOLDERS)}; allowed: {sorted(PLACEHOLDERS)}")
            return v

        @model_validator(mode="after")
        def _pattern_has_a_group(self):
            if re.compile(self.pattern).groups < 1:
                raise ValueError(f"pattern {self.pattern!r} needs a capture group for the verdict")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.pattern = re.compile(config.pattern, re.IGNORECASE)
        self.mapping = None if config.mapping is None else {k.lower(): v for k, v in config.mapping.items()}
        self._load()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.path, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.config.path).to(self.device).eval()

    def parse(self, verdict: str) -> float | None:
        """The score of the last match of `pattern` in `verdict`; None if absent or unmapped."""
        return last_score(self.pattern, self.mapping, verdict)

    def render(self, prompt: str, completion: str, answer: str = "") -> str:
        """The judge's input text: the template filled, in the chat format when the model has one."""
        text = self.config.template.format(prompt=prompt, completion=completion, answer=answer)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text

    def generate(self, texts: list[str]) -> list[str]:
        """Greedy continuations of `texts`, `batch_size` at a time."""
        import torch

        outputs: list[str] = []
        for i in range(0, len(texts), self.config.batch_size):
            batch = self.tokenizer(texts[i : i + self.config.batch_size], return_tensors="pt",
                                   padding=True).to(self.device)
            with torch.inference_mode():
                ids = self.model.generate(**batch, max_new_tokens=self.config.max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id)
            new = ids[:, batch["input_ids"].shape[1]:]  # left padding: every prompt ends at the same column
            outputs += self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return outputs

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        answers = columns.get("answer") or [""] * len(prompts)
        answers = ["" if a is None else str(a) for a in answers]
        texts = [self.render(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]
        return [self.parse(v) for v in self.generate(texts)]


@hookimpl
def register_rewards(register):
    register("judge", Judge)
