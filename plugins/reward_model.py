"""reward_model reward: scalar scores from a trained sequence-classification reward model."""

from __future__ import annotations

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl


class RewardModel:
    """Scores prompt + completion with a reward model (`AutoModelForSequenceClassification`, num_labels=1).

    Text longer than `max_length` tokens is cut from the left, so the end of the completion is scored.
    """

    class Config(PluginConfig):
        path: str = Field(description="checkpoint folder: model and tokenizer")
        batch_size: int = Field(8, ge=1)  # completions scored per forward pass
        max_length: int = Field(2048, ge=1, description="tokens per sample after truncation")
        device: str | None = Field(None, description="default: cuda when available, else cpu")

    def __init__(self, config: Config):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.config = config
        self.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(config.path)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(config.path).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"{config.path}: a reward model has num_labels=1, got {self.model.config.num_labels}")
        # The head pools at the last non-pad token, which it finds through pad_token_id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def score(self, texts: list[str]) -> list[float]:
        """One scalar per text, computed `batch_size` texts at a time."""
        import torch

        scores: list[float] = []
        for i in range(0, len(texts), self.config.batch_size):
            batch = self.tokenizer(texts[i : i + self.config.batch_size], return_tensors="pt", padding=True,
                                   truncation=True, max_length=self.config.max_length).to(self.device)
            mask = batch["attention_mask"]
            # Positions count real tokens only, so left padding does not shift them.
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                out = self.model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions)
            scores += out.logits[:, 0].float().tolist()
        return scores

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        return self.score([p + c for p, c in zip(prompts, completions, strict=True)])


@hookimpl
def register_rewards(register):
    register("reward_model", RewardModel)
