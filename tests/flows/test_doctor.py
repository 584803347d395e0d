import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.core.errors import AlignflowError
from alignflow.flows.doctor import LOCK, compare, cpu_meaning, findings, read_lock

REPO = Path(__file__).resolve().parents[2]


def test_this_environment_is_the_locked_one():
    """CI installs with `-c requirements/lock-cpu.txt`: every locked package is installed at its locked version."""
    pins = compare(read_lock(REPO / LOCK))
    assert len(pins) > 200 and {"torch", "transformers"} <= {p.name for p in pins}
    differ = [f"{p.name} {p.installed} (locked {p.locked})" for p in pins if not p.same]
    assert not differ, ("this environment differs from requirements/lock-cpu.txt: " + ", ".join(differ)
                        + "; install with -c requirements/lock-cpu.txt, or relock (scripts/lock.py)")


def test_a_wrong_pin_and_a_missing_package_are_reported_with_what_they_mean(tmp_path):
    lock = tmp_path / "lock.txt"
    real = importlib.metadata.version("transformers").split("+")[0]
    lock.write_text(f"# taken on CPython 2.7\ntransformers==0.0.1\nrich=={importlib.metadata.version('rich')}\n"
                    "no-such-package==1.0\n")
    pins = {p.name: p for p in compare(read_lock(lock))}
    assert [n for n, p in pins.items() if not p.same] == ["transformers", "no-such-package"]
    assert pins["transformers"].installed.split("+")[0] == real and pins["no-such-package"].installed is None
    found = dict(findings(list(pins.values()), ("2.7", "3.11")))
    assert found.keys() == {"Python 3.11, the lock's is 2.7", f"transformers {pins['transformers'].installed}, "
                            "locked 0.0.1", "no-such-package missing, locked 1.0"}
    assert "within their seed band" in found[f"transformers {pins['transformers'].installed}, locked 0.0.1"]
    assert "not installed" in found["no-such-package missing, locked 1.0"]


def test_a_shadowed_copy_later_on_sys_path_is_not_the_installed_version(tmp_path, monkeypatch):
    """setuptools puts its _vendor folder (older packaging, zipp, ...) at the end of sys.path once imported."""
    dist = tmp_path / "rich-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rich\nVersion: 0.0.1\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    real = importlib.metadata.version("rich")
    (pin,) = compare({"rich": real})
    assert pin.installed == real and pin.same


def test_a_lock_line_that_is_not_a_pin_names_the_file_and_line(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("torch==2.13.0\ntransformers>=5\n")
    with pytest.raises(AlignflowError, match=r"lock.txt, line 2: expected NAME==VERSION, got 'transformers>=5'"):
        read_lock(lock)


def test_the_cpu_kind_says_which_band_to_compare_with():
    avx512 = cpu_meaning({"kind": "AVX-512", "capability": "AVX512", "bf16": True})
    assert "AVX-512 band" in avx512 and "ATEN_CPU_CAPABILITY=avx2" in avx512 and "bf16-mixed" in avx512
    avx2 = cpu_meaning({"kind": "AVX2", "capability": "AVX2", "bf16": False})
    assert "AVX2 band" in avx2 and "ATEN_CPU_CAPABILITY" not in avx2 and "bf16" not in avx2


@pytest.mark.system
def test_doctor_exits_0_unless_strict_and_names_the_wrong_pin(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text((REPO / LOCK).read_text().replace("\ntransformers==", "\ntransformers==0.0.1\n#"))
    run = [sys.executable, "-m", "alignflow.flows.cli", "doctor", "--lock", str(lock)]
    env = {**os.environ, "COLUMNS": "400"}  # one line per finding, as the asserts read them
    done = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "transformers" in done.stdout and "locked 0.0.1): different" in done.stdout
    assert "numbers may differ from the published ones within their seed band" in done.stdout
    assert "cpu: " in done.stdout and "bubblewrap: " in done.stdout
    strict = subprocess.run([*run, "--strict"], capture_output=True, text=True, timeout=120, env=env)
    assert strict.returncode == 1, strict.stdout + strict.stderr

