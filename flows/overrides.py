"""`--set stage.field=value` overrides, applied to the raw spec before it is validated."""

from __future__ import annotations

from typing import Any

import yaml

from alignflow.core.errors import SpecError
from alignflow.core.spec.stage import plain_copy

TOP_LEVEL = ("name", "description", "seed")


def apply_overrides(raw: dict, sets: list[str]) -> dict:
    """A copy of `raw` with each `path=value` set; the value is parsed as YAML (`1e-3`, `[a, b]`)."""
    # A deep copy the caller's dict never shares, in the file's order (stages listed first get a free stage slot
    # first, and a loop's stages are shown in the order written), and one that shares nothing within itself: YAML
    # aliases (`settings: *rl`) load as one object, and a `--set` on one stage must not reach the others.
    raw = plain_copy(raw)
    for item in sets:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise SpecError(f"--set {item!r}: expected STAGE.FIELD=VALUE, e.g. sft.settings.lr=1e-3")
        value = yaml.safe_load(text)
        if keys[0] in TOP_LEVEL and len(keys) == 1:
            raw[keys[0]] = value
            continue
        stages = raw.get("stages") or {}
        if keys[0] not in stages:
            loops = [n for n, s in stages.items() if isinstance(s, dict) and keys[0] in (s.get("stages") or {})]
            hint = f"; a loop's stage is set for all its rounds as {loops[0]}.stages.{keys[0]}.FIELD" if loops else ""
            raise SpecError(f"--set {item!r}: no stage {keys[0]!r} (stages: {', '.join(stages)}){hint}")
        _set(stages, keys, value, item)
    return raw


def _set(node: Any, keys: list[str], value: Any, item: str) -> None:
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise SpecError(f"--set {item!r}: {'.'.join(keys[:i])} has no item {key!r}")
            key = int(key)
        elif not isinstance(node, dict):
            raise SpecError(f"--set {item!r}: {'.'.join(keys[:i])} is not a mapping")
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            elif isinstance(node[key], str):
                node[key] = {"name": node[key]}  # a bare plugin name, as in `selectors: [dedup]`
            node = node[key]
