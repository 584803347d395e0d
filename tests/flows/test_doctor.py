import importlib.metadata
import io
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


def test_doctor_reports_a_wrong_pin_and_exits_0_unless_strict(tmp_path, monkeypatch):
    from rich.console import Console

    from alignflow.flows import doctor

    lock = tmp_path / "lock.txt"
    lock.write_text((REPO / LOCK).read_text().replace("\ntransformers==", "\ntransformers==0.0.1\n#"))
    monkeypatch.setattr(doctor, "bubblewrap", lambda: None)  # its probe starts a sandbox: the system test's
    out = io.StringIO()
    assert doctor.report(lock, strict=False, show_all=False, console=Console(file=out, width=400)) == 0
    text = out.getvalue()
    assert "transformers" in text and "locked 0.0.1): different" in text and "torch " in text
    assert "numbers may differ from the published ones within their seed band" in text
    assert "cpu: " in text and "bubblewrap: works" in text and "as locked:" not in text  # no all-clear
    assert doctor.report(lock, strict=True, show_all=False, console=Console(file=io.StringIO())) == 1
    assert doctor.report(REPO / LOCK, strict=True, show_all=False, console=Console(file=io.StringIO())) == 0


@pytest.mark.system
def test_the_command_probes_bubblewrap_and_exits_1_under_strict_with_a_wrong_pin(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text((REPO / LOCK).read_text().replace("\ntransformers==", "\ntransformers==0.0.1\n#"))
    run = [sys.executable, "-m", "alignflow.flows.cli", "doctor", "--lock", str(lock), "--strict"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "locked 0.0.1): different" in done.stdout and "bubblewrap: " in done.stdout
