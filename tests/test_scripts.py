"""The maintainer scripts: dvc.yaml is what scripts/dvc_stages.py writes; scripts/lock.py reports what moved."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dvc_yaml_is_what_dvc_stages_writes_from_the_pipelines():
    """A new recipe or a changed data path: run `python scripts/dvc_stages.py`."""
    stages = script("dvc_stages")
    assert (ROOT / "dvc.yaml").read_text() == stages.dvc_yaml(), "dvc.yaml is stale: run scripts/dvc_stages.py"
    spec = {"stages": {"a": {"inputs": {"model": "builtin:tiny", "dataset": "data/tool-use/rl.jsonl"}},
                       "b": {"inputs": {"model": "stage:a", "dataset": "data/rl.jsonl",
                                        "constitution": "pipelines/constitution-tiny.txt"},
                             "environment": {"config": {"function": "examples/agents/arithmetic_retry.py:agent"}}}}}
    pipeline = ROOT / "pipelines" / "r1-tiny.yaml"
    assert stages.deps(pipeline, spec) == ["data", "data/tool-use", "examples/agents/arithmetic_retry.py",
                                           "pipelines/constitution-tiny.txt", "pipelines/r1-tiny.yaml"]
    assert stages.hub_models(spec) == []
    assert stages.hub_models({"stages": {"s": {"inputs": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}}}}) == [
        "Qwen/Qwen2.5-0.5B-Instruct"]


def test_lock_reports_each_package_added_removed_or_moved():
    lock = script("lock")
    old = {"torch": "2.13.0", "Transformers": "5.24.0", "rich": "14.0.0"}
    new = {"torch": "2.13.0", "transformers": "5.25.0", "pyyaml": "6.0.3"}
    assert lock.moved(old, new) == ["pyyaml: - -> 6.0.3", "rich: 14.0.0 -> -", "transformers: 5.24.0 -> 5.25.0"]
    pins = lock.read_lock(ROOT / "requirements" / "lock-cpu.txt")
    assert pins["torch"] == "2.13.0" and not any("+" in v for v in pins.values())  # matches +cpu and CUDA builds
    assert "alignflow" not in {k.lower() for k in pins}
