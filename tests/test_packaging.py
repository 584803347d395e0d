"""Both a wheel and an editable install expose alignflow.core, .flows (with its stage runners) and .plugins."""

import fcntl
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import alignflow.core

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_source_folders():
    assert Path(alignflow.core.__file__).resolve().parent == ROOT / "core"


def test_wheel_contains_the_three_packages_and_entry_points(tmp_path):
    tree = os.open(ROOT, os.O_RDONLY)  # pip builds in the tree: one build or editable install at a time, as
    try:  # .ci/run's `flock .` holds it while it installs the tree into another environment beside the tests
        fcntl.flock(tree, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], check=True)
    finally:
        os.close(tree)
    wheel = next(tmp_path.glob("alignflow-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ["alignflow/core/plugins.py", "alignflow/flows/cli.py", "alignflow/flows/stages/rl/stage.py",
                   "alignflow/plugins/__init__.py"]:
        assert module in names
    assert not any(n.startswith(("core/", "flows/", "plugins/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[alignflow]" in text and "alignflow = alignflow.flows.cli:main" in text

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    probe = ("import json, alignflow.core, alignflow.flows, alignflow.plugins, alignflow.flows.stages.rl.stage;"
             "from alignflow.core.plugins import get_plugins;"
             "print(json.dumps([alignflow.core.__file__, len(get_plugins().entries())]))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("ALIGNFLOW_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    path, _ = json.loads(out.stdout)
    assert Path(path).is_relative_to(target)
