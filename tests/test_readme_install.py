"""CI installs the project with the README's own command, and that command takes the lock."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_block():
    spec = importlib.util.spec_from_file_location("readme_block", ROOT / "scripts" / "readme_block.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.block


def test_ci_runs_the_readme_project_install_block_as_it_stands():
    block = readme_block()((ROOT / "README.md").read_text(), "project-install")
    assert block == 'pip install -c requirements/lock-cpu.txt -e ".[dev]"\n'
    assert (ROOT / "requirements" / "lock-cpu.txt").is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'install="$(python scripts/readme_block.py project-install)"' in ci
    assert 'bash -euo pipefail -c "$install"' in ci
    assert ci.index('"$install"') < ci.index("python -m pytest")  # installed before the tests
    assert '-e ".[dev]"' not in ci.replace(".ci/vllm-env", "")  # no second, drifting copy of the command


def test_the_readme_gives_the_clone_the_cpu_index_and_the_same_install_as_getting_started():
    readme = (ROOT / "README.md").read_text()
    assert "git clone https://github.com/alignflow/alignflow && cd alignflow" in readme
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    started = (ROOT / "docs" / "getting-started.md").read_text()
    assert readme_block()(readme, "project-install").strip() in started  # the docs say what the README says
    assert "git clone https://github.com/alignflow/alignflow" in started and "download.pytorch.org/whl/cpu" in started


def test_a_missing_or_malformed_block_is_an_error_naming_it():
    block = readme_block()
    with pytest.raises(ValueError, match="expected one block marked <!-- install -->, found 0"):
        block("no markers here", "install")
    with pytest.raises(ValueError, match="is not one ```bash fenced block"):
        block("<!-- install -->\npip install x\n<!-- /install -->", "install")
    assert block("<!-- install: a note -->\n```bash\na\nb\n```\n<!-- /install -->", "install") == "a\nb\n"
