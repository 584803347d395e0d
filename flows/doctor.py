"""`alignflow doctor`: this environment against the lock (requirements/lock-cpu.txt), the CPU and bubblewrap, and
what each difference means for reproducing the published numbers."""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

from alignflow.core.errors import AlignflowError
from alignflow.core.fingerprint import BF16_FLAGS, COMPUTE_LIBRARIES, _cpuinfo

LOCK = Path("requirements") / "lock-cpu.txt"
COMPUTE = {d for dists in COMPUTE_LIBRARIES.values() for d in dists}
# libraries that write the recipes' datasets (`alignflow data`): another version may write other bytes
DATA_WRITERS = {"reasoning-gym"}


@dataclass(frozen=True)
class Pin:
    """One locked package: the locked version and the installed one (None: not installed)."""

    name: str
    locked: str
    installed: str | None

    @property
    def same(self) -> bool:  # a local label (+cpu, +cu128) is the build, not the version
        return self.installed is not None and self.installed.split("+")[0] == self.locked


def normal(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def default_lock() -> Path:
    """The lock beside the working directory's checkout, else beside this installed checkout's sources."""
    here = Path.cwd() / LOCK
    return here if here.is_file() else Path(__file__).resolve().parents[1] / LOCK


def read_lock(path: Path) -> dict[str, str]:
    """{name: version} of a lock's `name==version` lines."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise AlignflowError(f"{path}: cannot read the lock ({exc.strerror}); pass --lock FILE") from None
    pins = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise AlignflowError(f"{path}, line {number}: expected NAME==VERSION, got {line!r}")
        pins[name.strip()] = version.strip()
    return pins


def lock_python(path: Path) -> str | None:
    """The Python version the lock was taken on (its header says), None when it does not say."""
    found = re.search(r"CPython (\d+\.\d+)", path.read_text())
    return found.group(1) if found else None


def compare(lock: dict[str, str]) -> list[Pin]:
    """Each locked package with the version installed here, in the lock's order."""
    installed: dict[str, str] = {}
    for dist in importlib.metadata.distributions():  # in sys.path order: the first is the one imported; later
        if dist.metadata["Name"]:                    # copies (setuptools' _vendor on sys.path) are shadowed
            installed.setdefault(normal(dist.metadata["Name"]), dist.version)
    return [Pin(name, version, installed.get(normal(name))) for name, version in lock.items()]


def cpu_kind() -> dict:
    """{flags: the vector and bf16 flags of /proc/cpuinfo, capability: torch's kernel level, kind: AVX2 / AVX-512}."""
    import torch

    flags = set((_cpuinfo().get("flags") or _cpuinfo().get("Features") or "").split())
    shown = sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_vnni"} | BF16_FLAGS)
    capability = torch.backends.cpu.get_cpu_capability()
    kind = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(capability, capability)
    return {"flags": shown, "capability": capability, "kind": kind, "bf16": bool(flags & BF16_FLAGS)}


def bubblewrap() -> str | None:
    """None when code_exec's bubblewrap sandbox works here, else why not (it starts one sandbox to know)."""
    from alignflow.core.sandbox.runner import default_python, namespaces_available

    return namespaces_available(default_python())


def meaning(pin: Pin) -> str:
    """What a package that differs from the lock means for reproducing the published numbers."""
    if pin.installed is None:
        return "not installed: what needs it cannot run (install with -c requirements/lock-cpu.txt)"
    if normal(pin.name) in COMPUTE:
        return ("computes every stage: its version enters every stage's digest, so cached stages rerun, and the "
                "numbers may differ from the published ones within their seed band")
    if normal(pin.name) in DATA_WRITERS:
        return "writes recipe data (`alignflow data`): the files may differ from what data.dvc pins (`dvc status`)"
    return "does not compute the numbers; a plugin's own distribution enters the digest of the stages using it"


def cpu_meaning(cpu: dict) -> str:
    """What this CPU kind means for comparing with published numbers."""
    bf16 = (" bf16 in hardware: `precision: auto` trains in bf16-mixed, whose numbers differ from fp32 ones;"
            if cpu["bf16"] else "")
    hold = (" ATEN_CPU_CAPABILITY=avx2 holds torch's kernels to AVX2 to compare with an AVX2 band;"
            if cpu["capability"] == "AVX512" else "")
    return (f"published numbers are per CPU kind: compare a run here with the {cpu['kind']} band, not with a figure "
            f"measured on another kind;{bf16}{hold}").rstrip(";")


def findings(pins: list[Pin], python: tuple[str | None, str]) -> list[tuple[str, str]]:
    """(what differs, what it means) for the Python version and each package that differs from the lock."""
    found = []
    locked, now = python
    if locked and locked != now:
        found.append((f"Python {now}, the lock's is {locked}",
                      "some pins may not exist for this Python; the numbers may differ within their seed band"))
    for pin in pins:
        if not pin.same:
            found.append((f"{pin.name} {pin.installed or 'missing'}, locked {pin.locked}", meaning(pin)))
    return found


def report(lock_path: Path, strict: bool, show_all: bool, console) -> int:
    """Print the comparison; 1 under `strict` when a package or Python differs or bubblewrap does not work."""
    import platform

    pins = compare(read_lock(lock_path))
    python = (lock_python(lock_path), ".".join(platform.python_version_tuple()[:2]))
    same = sum(p.same for p in pins)
    console.print(f"[bold]packages[/bold]: {same} of {len(pins)} as locked in {lock_path} (Python {python[1]}, "
                  f"the lock's {python[0] or 'unknown'})", highlight=False)
    for pin in pins:
        if show_all or normal(pin.name) in COMPUTE:
            mark = "same" if pin.same else "[red]different[/red]"
            console.print(f"  {pin.name} {pin.installed or 'missing'} (locked {pin.locked}): {mark}", highlight=False)
    found = findings(pins, python)
    for what, why in found:
        console.print(f"  [yellow]{what}[/yellow]: {why}", highlight=False, soft_wrap=True)
    cpu = cpu_kind()
    console.print(f"[bold]cpu[/bold]: {cpu['kind']} (torch's kernels: {cpu['capability']}; flags: "
                  f"{' '.join(cpu['flags']) or 'none of avx2, avx512f, bf16'})", highlight=False)
    console.print(f"  {cpu_meaning(cpu)}", highlight=False, soft_wrap=True)
    why = bubblewrap()
    console.print("[bold]bubblewrap[/bold]: " + ("works" if why is None else f"[yellow]does not work[/yellow]: {why}; "
                  "code_exec refuses with `isolation: namespaces` and otherwise runs model code with weaker "
                  "isolation (rlimits and a fresh uid); no other reward needs it"), highlight=False, soft_wrap=True)
    if not found and why is None:
        console.print("[green]as locked[/green]: a run here computes with the published results' versions; what "
                      "remains is the CPU kind's and the seed's spread")
    return 1 if strict and (found or why is not None) else 0
