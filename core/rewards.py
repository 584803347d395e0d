"""Weighted sets of reward plugins: resolve, call on a batch, isolate failing samples, count them."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from alignflow.core.errors import AlignflowError
from alignflow.core.spec.schema import validate_config

log = logging.getLogger(__name__)
_silent: set[str] = set()  # rewards already reported for a batch of only None


class RewardError(AlignflowError):
    """A reward broke its contract or failed on every sample of a batch."""


def completion_lengths(completions: list[str], columns: dict[str, Any]) -> list[int]:
    """Token counts from a `completion_lengths` or `completion_ids` column, else character counts."""
    if columns.get("completion_lengths") is not None:
        return [int(n) for n in columns["completion_lengths"]]
    if columns.get("completion_ids") is not None:
        return [len(ids) for ids in columns["completion_ids"]]
    return [len(c) for c in completions]


class Scores(list):
    """A reward's values with counts to log beside them, as `reward/<name>/<key>` (summed over batches)."""

    def __init__(self, values, counts: dict[str, float] | None = None):
        super().__init__(values)
        self.counts = dict(counts or {})


@dataclass
class Reward:
    """One resolved reward: its label, weight and callable (a function or a configured instance)."""

    name: str
    weight: float
    fn: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        call = self.fn if inspect.isfunction(self.fn) else getattr(self.fn, "__call__", None)
        return inspect.iscoroutinefunction(call)


@dataclass
class RewardOutput:
    """Per-sample weighted totals, each reward's raw values, and metrics for logging."""

    total: list[float]
    values: dict[str, list[float | None]]
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def join(cls, parts: list["RewardOutput"]) -> "RewardOutput":
        """The output of consecutive batches as one batch's: what `RewardSet` gives the whole batch."""
        total = [t for p in parts for t in p.total]
        values = {name: [v for p in parts for v in p.values[name]] for name in parts[0].values}
        failed = {name: sum(p.metrics.get(f"reward/{name}/failed", 0.0) for p in parts) for name in values}
        metrics = _metrics(total, values, failed)
        counts = {k for p in parts for k in p.metrics if k not in metrics and not k.endswith("/mean")}
        metrics.update({k: sum(p.metrics.get(k, 0.0) for p in parts) for k in sorted(counts)})
        return cls(total, values, metrics)


def _metrics(total: list[float], values: dict[str, list[float | None]], failed: dict[str, float]) -> dict[str, float]:
    """The total's mean, and each reward's mean over the samples it scored, unscored and failed counts."""
    n = len(total)
    metrics = {"reward/total/mean": sum(total) / n if n else 0.0}
    for name, vals in values.items():
        scored = [v for v in vals if v is not None]
        metrics[f"reward/{name}/none"] = float(n - len(scored))
        metrics[f"reward/{name}/failed"] = float(failed[name])
        if scored:
            metrics[f"reward/{name}/mean"] = sum(scored) / len(scored)
    return metrics


def reward_labels(names: list[str]) -> list[str]:
    """Each listed reward's label: its name, or NAME_i (i its place in the list) for a reward listed twice, as
    two judges."""
    return [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]


class RewardSet:
    """Rewards combined by weight; None scores add 0 to the total and are counted, never fatal alone."""

    def __init__(self, rewards: list[Reward]):
        labels = [r.name for r in rewards]
        if len(set(labels)) != len(labels):
            raise RewardError(f"reward labels must be unique, got {labels}")
        self.rewards = rewards

    @classmethod
    def from_refs(cls, refs: Iterable[Any], plugins=None) -> "RewardSet":
        """Build from (name, weight[, config]) tuples; class rewards get their Config (a stage's come resolved)."""
        if plugins is None:
            from alignflow.core.plugins import get_plugins

            plugins = get_plugins()
        refs = [(name, float(weight), dict(rest[0]) if rest else {}) for name, weight, *rest in refs]
        rewards = []
        for i, ((name, weight, config), label) in enumerate(zip(refs, reward_labels([n for n, _, _ in refs]))):
            obj = plugins.rewards.get(name)
            validated = validate_config(obj, config, f"rewards[{i}] ({name}).config")
            fn = obj(validated) if inspect.isclass(obj) else obj
            rewards.append(Reward(label, weight, fn))
        return cls(rewards)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> RewardOutput:
        """Score a batch with every reward; `columns` are the dataset's other columns, batch-aligned."""
        n = len(prompts)
        if len(completions) != n:
            raise RewardError(f"{n} prompts but {len(completions)} completions")
        results = {r.name: _score(r, prompts, completions, columns) for r in self.rewards if not r.is_async}
        pending = [r for r in self.rewards if r.is_async]
        if pending:  # async rewards (e.g. remote judges) run concurrently
            async def gather():
                return await asyncio.gather(*(_ascore(r, prompts, completions, columns) for r in pending))

            results.update(zip([r.name for r in pending], asyncio.run(gather())))
        values = {r.name: results[r.name][0] for r in self.rewards}
        total = [
            sum(r.weight * v for r in self.rewards if (v := values[r.name][i]) is not None)
            for i in range(n)
        ]
        metrics = _metrics(total, values, {r.name: results[r.name][1] for r in self.rewards})
        for r in self.rewards:
            metrics.update({f"reward/{r.name}/{k}": v for k, v in results[r.name][2].items()})
        return RewardOutput(total, values, metrics)


def _row(i: int, n: int, prompts, completions, columns) -> dict[str, Any]:
    """Sample i as a batch of one; non-list columns pass through unchanged."""
    row = {k: [v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in columns.items()}
    return {"prompts": [prompts[i]], "completions": [completions[i]], **row}


def _check(reward: Reward, out: Any, n: int) -> list[float | None]:
    """Validate a reward's output: n entries, each None or a real number (NaN counts as None)."""
    if not isinstance(out, (list, tuple)) or len(out) != n:
        got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
        raise RewardError(f"reward {reward.name!r} returned {got} for a batch of {n}; expected a list of {n}")
    values = []
    for v in out:
        if v is not None and (isinstance(v, (str, bytes)) or not hasattr(type(v), "__float__")):
            raise RewardError(f"reward {reward.name!r} returned {v!r}; expected a float or None")
        v = None if v is None else float(v)
        values.append(None if v is None or math.isnan(v) else v)
    return values


def _fail(reward: Reward, values: list, failed: int, first: BaseException | None) -> tuple[list, int]:
    """A reward that raised on every sample stops the stage; one that had no opinion on any (returned
    None for all, e.g. a code reward on a batch of math prompts) is only counted (`reward/NAME/none`)."""
    if values and all(v is None for v in values) and first is not None:
        raise RewardError(f"reward {reward.name!r} failed on every sample of a batch of {len(values)}: "
                          f"{type(first).__name__}: {first}")
    if values and all(v is None for v in values) and reward.name not in _silent:
        _silent.add(reward.name)
        log.warning("reward %r returned None (no opinion) for every sample of a batch of %d", reward.name,
                    len(values))
    return values, failed


def _counts(out: Any, into: dict[str, float]) -> None:
    for key, v in getattr(out, "counts", {}).items():
        into[key] = into.get(key, 0.0) + float(v)


def _score(reward: Reward, prompts, completions, columns) -> tuple[list[float | None], int, dict]:
    """Call on the whole batch; if that raises, call per sample so one bad sample costs only itself."""
    n, counts = len(prompts), {}
    try:
        out = reward.fn(prompts=prompts, completions=completions, **columns)
        _counts(out, counts)
        return *_fail(reward, _check(reward, out, n), 0, None), counts
    except RewardError:
        raise
    except Exception as exc:
        first = exc
        if n == 1:
            return *_fail(reward, [None], 1, first), counts
        log.warning("reward %r raised on a batch (%s); retrying per sample", reward.name, exc)
    values, failed = [], 0
    for i in range(n):
        try:
            out = reward.fn(**_row(i, n, prompts, completions, columns))
            values += _check(reward, out, 1)
            _counts(out, counts)
        except RewardError:
            raise
        except Exception:
            values.append(None)
            failed += 1
    return *_fail(reward, values, failed, first), counts


async def _ascore(reward: Reward, prompts, completions, columns) -> tuple[list[float | None], int, dict]:
    """The async twin of `_score`: per-sample retries run concurrently."""
    n, counts = len(prompts), {}
    try:
        out = await reward.fn(prompts=prompts, completions=completions, **columns)
        _counts(out, counts)
        return *_fail(reward, _check(reward, out, n), 0, None), counts
    except RewardError:
        raise
    except Exception as exc:
        first = exc
    outs = await asyncio.gather(
        *(reward.fn(**_row(i, n, prompts, completions, columns)) for i in range(n)), return_exceptions=True
    )
    values = [None if isinstance(o, Exception) else _check(reward, o, 1)[0] for o in outs]
    for o in outs:
        _counts(o, counts)
    return *_fail(reward, values, sum(isinstance(o, Exception) for o in outs), first), counts
