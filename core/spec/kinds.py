"""Stage kinds: one record per kind, the only place a kind is described; every per-kind table derives from it."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from alignflow.core.contracts import PluginConfig
from alignflow.core.errors import DataError, SpecError
from alignflow.core.spec.settings import (CritiqueSettings, EvaluateSettings, PolicySettings, PRMSettings, RLSettings,
                                     SampleSettings, SelectSettings, StepLabelSettings, TrainSettings, critique_rows,
                                     sampled_rows)

# The row schema (alignflow.core.train.datasets.SCHEMAS) a stage's `dataset` input holds, for the kinds where it
# depends on the stage: (stage spec, plugins) -> schema. None: any JSON objects.
SchemaOf = Callable[[Any, Any], "str | None"]


def preference_rows(algo, dataset) -> str:
    """The rows a preference stage trains `algo` on: unpaired for one that `requires_labels`; ranked lists for one
    that `accepts_lists` when the dataset is a JSONL file of them (a `rejection_sampling` stage's `output: lists`);
    else pairs."""
    if getattr(algo, "requires_labels", False):
        return "unpaired"
    return "ranked" if getattr(algo, "accepts_lists", False) and ranked_file(dataset) else "pairwise"


def ranked_file(source) -> bool:
    """Whether `source` is a JSONL file whose first row is a ranked list (has `completions`); a missing or
    unreadable file is not (loading it reports why)."""
    from alignflow.core.train.datasets import iter_jsonl

    if not str(source).endswith(".jsonl"):
        return False
    try:
        first = next(iter_jsonl(Path(source)), (0, None))[1]
    except (OSError, DataError):
        return False
    return isinstance(first, dict) and "completions" in first


def _preference_rows(stage, plugins) -> str:
    """pairwise; unpaired for an algorithm that `requires_labels`; ranked for lists, to one that `accepts_lists`"""
    return preference_rows(plugins.algorithms.get(stage.algorithm.name), stage.inputs.get("dataset", ""))


def episode_rows(stage, plugins) -> str:
    """The rows a stage needs to play episodes: `prompt` (the default `reset`'s first message, and what rewards
    get as the prompt), and `answer` too where the stage reads it: a listed reward with a parameter `answer`
    (math_accuracy) or an algorithm with guided samples (ExPO shows it). Without `plugins`, both."""
    if plugins is None:
        return "prompt_answer"
    rewards = [plugins.rewards.get(r.name) for r in stage.rewards if r.name in plugins.rewards]
    name = stage.algorithm.name if stage.algorithm is not None else None
    algorithm = plugins.algorithms.get(name) if name in plugins.algorithms else None
    return "prompt_answer" if any(map(_takes_answer, rewards)) or _guided(algorithm) else "prompt"


def _takes_answer(reward) -> bool:
    """Whether a reward (a function, or a class called per batch) has a parameter `answer` without a default."""
    call = reward if inspect.isfunction(reward) else getattr(reward, "__call__", None)
    try:
        param = inspect.signature(call).parameters.get("answer")
    except (TypeError, ValueError):  # no signature to read: it takes what it is given
        return False
    return param is not None and param.default is param.empty and param.kind in (param.POSITIONAL_OR_KEYWORD,
                                                                                  param.KEYWORD_ONLY)


def _guided(algorithm) -> bool:
    """Whether an algorithm class has guided samples. Looked up, not imported (the spec must not import the RL
    code, which imports it): an algorithm that subclasses the capability has loaded its module."""
    capabilities = sys.modules.get("alignflow.core.rl.capabilities")
    return inspect.isclass(algorithm) and capabilities is not None and issubclass(algorithm,
                                                                                capabilities.GuidedSamples)


def _rejection_rows(stage, plugins) -> str:
    """prompt_answer; sft for `output: self_play`"""
    return sampled_rows(stage.settings.get("output", "sft"))


def _critique_rows(stage, plugins) -> str:
    """prompt; prompt_answer when it lists rewards"""
    return critique_rows(bool(stage.rewards))


@dataclass(frozen=True)
class StageKind:
    """What a pipeline, the planner and the launcher know of one stage kind; its runner is in flows/stages."""

    name: str
    # input name -> the upstream output (`model` | `dataset`) a `stage:NAME` value reads; None: a file only
    inputs: Mapping[str, str | None]
    required: frozenset[str]  # inputs it cannot run without
    plugins: frozenset[str]  # of algorithm, rewards, sampler, selectors, environment; an `algorithm` is then required
    settings: type[PluginConfig]  # the model that validates its `settings:` block
    schema: str | SchemaOf | None  # the row schema of its `dataset` input (None: any JSON objects)
    outputs: frozenset[str]  # what it writes: `model` and/or `dataset`
    doc: str = ""
    needs_rewards: bool = False  # at least one reward, or an environment where it takes one
    samples: bool = False  # generates with or without rewards: its sampler is always filled in
    schema_needs_plugins: bool = False  # `schema` reads the stage's algorithm: known once plugins load
    training: bool = False  # trains a model with the shared engine (its memory is estimated)
    value_head: bool = False  # trains a one-output sequence-classification model
    online_sampler: bool = False  # its sampler lives beside the trainer and takes each update's weights
    # Its runner splits its rows (each step's, or the prompts to sample) over the ranks of a process group.
    data_parallel: bool = False
    # Its result depends on the number of ranks beyond float rounding (each rank samples its share of the
    # rollouts with its own seed): the number is part of its digest.
    rank_dependent: bool = False
    # Its runner touches no process-wide state (the others seed torch's global RNG, share DeepSpeed's
    # process group, import transformers lazily), so sibling stages may run it in threads at once; one
    # that scores rows with rewards loads models and is not, whatever this says.
    thread_safe: bool = False

    def dataset_schema(self, stage, plugins=None) -> str | None:
        """The row schema stage `stage`'s `dataset` holds; `plugins` are needed where `needs_plugins(stage)`.
        A stage that plays episodes needs `answer` only where it reads it (`episode_rows`)."""
        schema = self.schema(stage, plugins) if callable(self.schema) else self.schema
        return episode_rows(stage, plugins) if schema == "prompt_answer" and self.plays_episodes(stage) else schema

    def plays_episodes(self, stage) -> bool:
        """Whether `stage` samples multi-turn episodes: its kind takes an environment and it names one."""
        return "environment" in self.plugins and getattr(stage, "environment", None) is not None

    def needs_plugins(self, stage) -> bool:
        """Whether `stage`'s row schema is known only once its plugins load (its algorithm's, or its rewards')."""
        return self.schema_needs_plugins or self.plays_episodes(stage)


MODEL, DATASET = "model", "dataset"
TRAIN_INPUTS = {"model": MODEL, "dataset": DATASET, "eval_dataset": DATASET}
SCORERS = {"reward_model": MODEL, "prm": MODEL, "verifier": MODEL}  # a trained scorer, for rewards that load one
REQUIRED = frozenset({"model", "dataset"})
# Training stages may list rewards (and a sampler) to score `eval_dataset` completions at the end.
POLICY_PLUGINS = frozenset({"algorithm", "rewards", "sampler"})
SAMPLING_PLUGINS = frozenset({"rewards", "sampler"})
EPISODE_PLUGINS = SAMPLING_PLUGINS | {"environment"}  # stages whose samples may be multi-turn episodes


def _train(name: str, settings, schema, plugins=frozenset({"algorithm"}), inputs=(), **flags) -> StageKind:
    return StageKind(name, {**TRAIN_INPUTS, **dict(inputs)}, REQUIRED, plugins, settings, schema,
                     frozenset({MODEL}), training=True, data_parallel=True, **flags)


_RECORDS = (
    StageKind("select", {"dataset": DATASET, **SCORERS}, frozenset({"dataset"}), frozenset({"selectors", "rewards"}),
              SelectSettings, None, frozenset({DATASET}), thread_safe=True,
              doc="filters, orders or scores rows; rewards score prompt/completion rows before the selectors run"),
    _train("sft", PolicySettings, "sft", POLICY_PLUGINS, doc="supervised fine-tuning on prompt/completion rows"),
    _train("reward_model", TrainSettings, "pairwise", value_head=True, doc="a reward model from preference pairs"),
    _train("prm", PRMSettings, "steps", value_head=True, doc="a process reward model from labelled steps"),
    _train("preference", PolicySettings, _preference_rows, POLICY_PLUGINS, {"reference": MODEL},
           schema_needs_plugins=True, doc="offline preference optimisation (DPO and kin)"),
    _train("rl", RLSettings, "prompt_answer", POLICY_PLUGINS | {"environment"},
           {"reference": MODEL, **SCORERS, "critic": MODEL, "teacher": MODEL}, needs_rewards=True,
           online_sampler=True, rank_dependent=True, doc="online RL: generate, score, update"),
    StageKind("rejection_sampling", {"model": MODEL, "dataset": DATASET, **SCORERS}, REQUIRED, EPISODE_PLUGINS,
              SampleSettings, _rejection_rows, frozenset({DATASET}), needs_rewards=True, data_parallel=True,
              doc="samples completions and keeps the best (or pairs) by reward"),
    # Constitutional AI: `model` answers, critiques its answer against a principle drawn from the
    # `constitution` file and revises it; rewards, when listed, score the original and the revision.
    StageKind("critique_revise", {"model": MODEL, "dataset": DATASET, "constitution": None, **SCORERS},
              REQUIRED | {"constitution"}, SAMPLING_PLUGINS, CritiqueSettings, _critique_rows,
              frozenset({DATASET}), samples=True, doc="Constitutional AI's critique and revision"),
    # Math-Shepherd: `model` samples solutions, `completer` (default: `model`) completes their step
    # prefixes, the rewards judge the completions.
    StageKind("step_labels", {"model": MODEL, "dataset": DATASET, "completer": MODEL}, REQUIRED, SAMPLING_PLUGINS,
              StepLabelSettings, "prompt_answer", frozenset({DATASET}), needs_rewards=True, data_parallel=True,
              doc="Math-Shepherd step labels from completed step prefixes"),
    StageKind("evaluate", {"model": MODEL, "dataset": DATASET, **SCORERS}, REQUIRED, EPISODE_PLUGINS,
              EvaluateSettings, "prompt_answer", frozenset({DATASET}), needs_rewards=True, data_parallel=True,
              doc="accuracy and pass@k of sampled completions"),
)
KINDS: dict[str, StageKind] = {record.name: record for record in _RECORDS}


def stage_kind(name: str) -> StageKind:
    """The record of kind `name`; a SpecError naming the known kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise SpecError(f"unknown stage kind {name!r}: expected one of {', '.join(KINDS)}") from None


def settings_model(kind: str) -> type[PluginConfig]:
    """The settings model of stage kind `kind`."""
    return stage_kind(kind).settings


# Derived tables, under the names the rest of the code imports.
SETTINGS: dict[str, type[PluginConfig]] = {k: r.settings for k, r in KINDS.items()}
TRAINING_KINDS = tuple(k for k, r in KINDS.items() if r.training)
VALUE_HEAD_KINDS = tuple(k for k, r in KINDS.items() if r.value_head)
THREAD_SAFE_KINDS = frozenset(k for k, r in KINDS.items() if r.thread_safe)
DATA_PARALLEL_KINDS = frozenset(k for k, r in KINDS.items() if r.data_parallel)
RANK_DEPENDENT_KINDS = frozenset(k for k, r in KINDS.items() if r.rank_dependent)
# Which upstream output a `stage:NAME` input reads, by the input's name (the same in every kind).
OUTPUT_OF_INPUT: dict[str, str] = {i: out for r in KINDS.values() for i, out in r.inputs.items() if out is not None}
OUTPUTS = frozenset(out for r in KINDS.values() for out in r.outputs)


def kinds_markdown() -> str:
    """The stage-kind table as Markdown: inputs (required in bold), plugins, settings, schema, outputs, ranks."""
    rows = ["| kind | inputs | plugins | settings model | dataset schema | outputs | data-parallel |",
            "|---|---|---|---|---|---|---|"]
    for r in KINDS.values():
        inputs = ", ".join(f"**{i}**" if i in r.required else i for i in r.inputs)
        plugins = ", ".join(p + ("" if p != "rewards" or not r.needs_rewards else " (1+)") for p in sorted(r.plugins))
        # a schema that depends on the stage is described by its function's docstring
        schema = r.schema.__doc__ if callable(r.schema) else r.schema or "any JSON objects"
        if "environment" in r.plugins:
            schema += "; with an environment: prompt, and answer where a reward or the algorithm reads it"
        rows.append(f"| `{r.name}` | {inputs} | {plugins} | `{r.settings.__name__}` | {schema} | "
                    f"{', '.join(sorted(r.outputs))} | {'yes' if r.data_parallel else 'no'} |")
    return "\n".join(rows)
