"""The small contracts plugins implement: algorithms, rewards, samplers, selectors."""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

StageKind = Literal[
    "select", "sft", "reward_model", "prm", "preference", "rl", "rejection_sampling", "critique_revise",
    "step_labels", "evaluate",
]


class PluginConfig(BaseModel):
    """Base for every plugin's `Config`: unknown fields are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


NOT_IN_DIGEST = {"digest": False}  # a field's `json_schema_extra` that keeps it out of the stage digest


def operational(default: Any = ..., **kwargs: Any) -> Any:
    """A config field about how a plugin reaches what it uses (a server's URL, timeouts, retries), not what
    it computes: `digest_dump` leaves it out, so moving a scorer to another host reruns no stage."""
    return Field(default, json_schema_extra=NOT_IN_DIGEST, **kwargs)


def is_operational(field: Any) -> bool:
    """Whether a pydantic `FieldInfo` is marked `json_schema_extra={"digest": False}`."""
    extra = getattr(field, "json_schema_extra", None)
    return isinstance(extra, dict) and extra.get("digest") is False


def digest_dump(model: BaseModel) -> dict:
    """`model_dump(mode="json")` without its operational fields, at any depth: what a stage digest hashes."""
    return model.model_dump(mode="json", exclude=_operational(model) or None)


def _operational(value: Any) -> Any:
    """Pydantic's `exclude` for the operational fields within `value` (a model, or a list or dict of them)."""
    if isinstance(value, BaseModel):
        out = {}
        for name, field in type(value).model_fields.items():
            inner = True if is_operational(field) else _operational(getattr(value, name))
            if inner:
                out[name] = inner
        return out
    if isinstance(value, (list, tuple)):
        return {i: inner for i, item in enumerate(value) if (inner := _operational(item))}
    if isinstance(value, dict):
        return {k: inner for k, item in value.items() if (inner := _operational(item))}
    return {}


class Algorithm:
    """A training objective for one stage kind; a stage builds its inputs from the flags below."""

    # the plugin's pydantic config, validated from the pipeline's `config:` block
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    stage: ClassVar[str] = ""  # the stage kind it trains: sft, preference, reward_model, prm or rl
    requires_reference: ClassVar[bool] = False  # frozen reference model log-probs
    requires_critic: ClassVar[bool] = False  # a value head trained alongside the policy
    requires_pairs: ClassVar[bool] = False  # prompt/chosen/rejected rows
    requires_labels: ClassVar[bool] = False  # prompt/completion/label rows (unpaired)

    def __init__(self, config: PluginConfig | None = None):
        self.config = config if config is not None else self.Config()


class Sampler:
    """Generates `n` completions per prompt: token ids, text, and log-probs when it has them."""

    Config: ClassVar[type[PluginConfig]] = PluginConfig  # validated from the stage's `sampler: {config: ...}`
    online: ClassVar[bool] = True  # takes new policy weights after each update
    loads_checkpoint: ClassVar[bool] = False  # sampling stages pass a checkpoint folder to `load`, not a module

    def __init__(self, config: PluginConfig | None = None):
        self.config = config if config is not None else self.Config()

    def load(self, model: Any, tokenizer: Any) -> None:
        """Take the initial policy (a module or a checkpoint path) and its tokenizer."""
        raise NotImplementedError

    def generate(self, prompt_ids: list[list[int]], n: int, gen: Any, seed: int) -> Any:
        """Return an `alignflow.core.sampling.Generation` with `n` completions per prompt."""
        raise NotImplementedError

    def generate_episodes(self, episodes: Any, tokenizer: Any, rows: list[dict], n: int, gen: Any, seed: int) -> Any:
        """`n` multi-turn episodes per row on `episodes`' environment (`alignflow.core.environments.Episodes`),
        as one Generation. The default runs them here, one `generate` call per turn of every running episode;
        a sampler that runs episodes elsewhere (a worker, an engine's own agent loop) overrides it."""
        return episodes.generate(self, tokenizer, rows, n, gen, seed)

    @contextmanager
    def continuing(self, episodes: list[Hashable]) -> Iterator[None]:
        """The `generate` calls inside are the next turns of these episodes (a key per prompt, the same over an
        episode's turns; each prompt extends the episode's last prompt and completion): a sampler may keep what
        it computed for each (a KV cache) until `end_episodes`, and compute only the tokens that are new. Optional."""
        yield

    def end_episodes(self, episodes: list[Hashable]) -> None:
        """These episodes are over: free what `continuing` kept for them. Optional."""

    def update_weights(self, model: Any) -> None:
        """Take the policy's new weights after an optimizer update."""
        raise NotImplementedError

    def set_precision(self, precision: str) -> None:
        """The training stage's resolved compute precision (`fp32`, `bf16-mixed` or `bf16`), given before
        `load`, so generation computes as the trainer does. Optional: a sampler may keep its own."""

    def release(self) -> None:
        """The trainer is about to step: free what generation holds (a GPU engine's memory). Optional."""

    def close(self) -> None:
        """The stage is done with this sampler: stop engines, remove temporary files. Optional."""


class Selector:
    """Chooses or reorders dataset rows before training (filters, curricula, dedup)."""

    # validated from the selector's `config:` in the stage's `selectors` list
    Config: ClassVar[type[PluginConfig]] = PluginConfig

    def __init__(self, config: PluginConfig | None = None):
        self.config = config if config is not None else self.Config()


RewardFn = Callable[..., "list[float | None]"]


def plugin_config_model(obj: Any) -> type[BaseModel] | None:
    """The pydantic model that validates a plugin's `config:` block; None if it takes no config."""
    model = getattr(obj, "Config", None)
    if inspect.isclass(model) and issubclass(model, BaseModel):
        return model
    return None
