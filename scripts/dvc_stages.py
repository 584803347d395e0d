"""Write dvc.yaml: one stage per shipped recipe in pipelines/, so `dvc repro` reruns each when its spec or data change.

    python scripts/dvc_stages.py           # rewrite dvc.yaml from pipelines/*.yaml
    python scripts/dvc_stages.py --check   # exit 1 when dvc.yaml is not what it would write

Each stage runs `alignflow run` on its pipeline, depends on the pipeline file, the data folders it reads (`data`
for the bundled task's files, `data/tool-use` and the like for a recipe's own) and any other file of the
repository it names, and writes its final metrics to metrics/NAME.json and its curves under metrics/plots/NAME
(both kept in git, not in DVC's cache). A recipe that loads a model from the Hugging Face Hub (the Qwen2.5 ones:
a GPU, vLLM and a download) is left out and named in the file's header.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HEADER = ("Written by `python scripts/dvc_stages.py` from pipelines/ (edit a pipeline, not this file): one stage "
          "per shipped recipe. `dvc repro` reruns a stage when its spec or the data it reads change; the pipeline's "
          "own digests then skip every stage of it whose inputs and config did not change. `dvc repro NAME` runs "
          "one. Not stages, as they load a model from the Hugging Face Hub and need a GPU: {skipped}.")


def strings(node) -> list[str]:
    """Every string value in a parsed YAML document."""
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def hub_models(spec: dict) -> list[str]:
    """The models a pipeline's stages load that are neither built here (`builtin:`) nor another stage's."""
    models = [(stage.get("inputs") or {}).get("model") for stage in (spec.get("stages") or {}).values()]
    return [m for m in models if isinstance(m, str) and not m.startswith(("builtin:", "stage:"))]


def deps(pipeline: Path, spec: dict) -> list[str]:
    """The pipeline file, the data folders it reads and the other repository files it names."""
    found = {pipeline.relative_to(ROOT).as_posix()}
    for value in strings(spec):
        path = Path(value.split(":")[0] if ".py:" in value else value)
        if path.is_absolute() or not path.parts or not (ROOT / path).is_file():
            continue
        if path.parts[0] == "data":  # the folder it lies in: the bundled files' is data itself
            found.add(path.parent.as_posix())
        else:
            found.add(path.as_posix())
    return sorted(found)


def stage(name: str, dependencies: list[str]) -> dict:
    metrics, plots = f"metrics/{name}.json", f"metrics/plots/{name}"
    return {"cmd": f"alignflow run pipelines/{name}.yaml --json --metrics {metrics} --plots {plots}",
            "deps": dependencies, "metrics": [{metrics: {"cache": False}}],
            "plots": [{plots: {"cache": False, "x": "step", "y": "value"}}]}


def dvc_yaml() -> str:
    """The text of dvc.yaml for the pipelines in pipelines/."""
    stages, skipped = {}, []
    for pipeline in sorted((ROOT / "pipelines").glob("*.yaml")):
        spec = yaml.safe_load(pipeline.read_text())
        if hub_models(spec):
            skipped.append(pipeline.stem)
            continue
        stages[pipeline.stem] = stage(pipeline.stem, deps(pipeline, spec))
    body = yaml.safe_dump({"stages": stages}, sort_keys=False, width=120)
    note = textwrap.fill(HEADER.format(skipped=", ".join(skipped) or "none"), 114, initial_indent="# ",
                         subsequent_indent="# ")
    return note + "\n" + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when dvc.yaml differs")
    args = parser.parse_args()
    text, path = dvc_yaml(), ROOT / "dvc.yaml"
    if args.check:
        current = path.read_text() if path.is_file() else ""
        print("dvc.yaml is current" if current == text else "dvc.yaml differs: run scripts/dvc_stages.py",
              file=sys.stderr)
        return 0 if current == text else 1
    path.write_text(text)
    print(f"dvc.yaml: {len(yaml.safe_load(text)['stages'])} stages",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
