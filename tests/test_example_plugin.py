"""A third-party plugin, pip-installed into a throwaway location, is listed and usable by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "alignflow-plugin-example"
ALIGNFLOW = [sys.executable, "-m", "alignflow.flows.cli"]

PIPELINE = """
name: uses-example
stages:
  prefs:
    kind: preference
    inputs: {model: ./base, dataset: data/pairs.jsonl}
    algorithm: {name: hinge, config: {delta: 0.5}}
  games:
    kind: evaluate
    inputs: {model: "stage:prefs", dataset: data/pairs.jsonl}
    environment: {name: guess, config: {high: 20}, max_turns: 5}
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        check=True,
    )
    return target


def run(args, site=None, **kw):
    env = dict(os.environ)
    env.pop("ALIGNFLOW_PLUGINS", None)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run(ALIGNFLOW + args, capture_output=True, text=True, env=env, **kw)


def test_plugins_lists_the_example_with_its_distribution(site):
    out = run(["plugins", "--json"], site)
    assert out.returncode == 0, out.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)}
    for key in [("algorithm", "hinge"), ("algorithm", "reinforce"), ("reward", "answer_digits"), ("environment", "guess")]:
        assert rows[key]["distribution"] == "alignflow-plugin-example"
        assert rows[key]["version"] == "0.1.0"
        assert rows[key]["description"]
    assert all(set(r) == {"kind", "name", "distribution", "version", "description", "stage", "entry_point",
                          "config_schema"} for r in rows.values())
    assert rows[("algorithm", "hinge")]["stage"] == "preference"
    assert rows[("algorithm", "hinge")]["config_schema"]["properties"]["delta"]["default"] == 1.0


def test_validate_accepts_a_pipeline_using_it_only_when_installed(site, tmp_path):
    pipe = tmp_path / "uses-example.yaml"
    pipe.write_text(PIPELINE)
    (tmp_path / "base").mkdir()  # inputs are checked too, relative to the project: where alignflow runs
    ok = run(["validate", str(pipe)], site, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "prefs" in ok.stdout and "hinge" in ok.stdout and "guess" in ok.stdout
    missing = run(["validate", str(pipe)], cwd=tmp_path)
    assert missing.returncode == 1
    assert "stage 'prefs', algorithm.name: unknown algorithm 'hinge'" in missing.stderr


def test_hinge_loss_matches_the_formula(site, monkeypatch):
    """max(0, δ − β·h), h = (π_w − ref_w) − (π_l − ref_l); the stage's generic batch builder feeds it."""
    import torch

    monkeypatch.syspath_prepend(str(site))
    from alignflow_plugin_example.hinge import Hinge

    from alignflow.core.train.offline import PairBatch

    algo = Hinge(Hinge.Config(beta=0.5, delta=1.0))
    batch = PairBatch(policy_chosen_logps=torch.tensor([-1.0, -4.0]), policy_rejected_logps=torch.tensor([-3.0, -2.0]),
                      chosen_lengths=torch.tensor([2, 2]), rejected_lengths=torch.tensor([2, 2]),
                      ref_chosen_logps=torch.tensor([-2.0, -3.0]), ref_rejected_logps=torch.tensor([-2.0, -2.0]))
    loss, metrics = algo.loss(batch)
    # pair 1: h = (-1 - -2) - (-3 - -2) = 2 -> max(0, 1 - 0.5*2) = 0
    # pair 2: h = (-4 - -3) - (-2 - -2) = -1 -> max(0, 1 + 0.5) = 1.5
    assert loss.item() == pytest.approx((0.0 + 1.5) / 2)
    assert metrics["rewards/accuracies"].item() == pytest.approx(0.5)
