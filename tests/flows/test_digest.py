import os
import sqlite3
import sys
import time

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.overrides import apply_overrides
from alignflow.flows.plan import plan_pipeline

import yaml


def digests(project, sets=()) -> dict[str, str]:
    raw = apply_overrides(yaml.safe_load((project / "chain.yaml").read_text()), list(sets))
    return {n: p.digest for n, p in plan_pipeline(parse_spec(raw), project, get_plugins()).items()}


def changed(a: dict, b: dict) -> set[str]:
    return {n for n in a if a[n] != b[n]}


def test_digest_reaches_a_stage_and_its_descendants_only(tmp_path, make_project):
    project = make_project(tmp_path)
    base = digests(project)
    assert base == digests(project)
    assert changed(base, digests(project, ["c.selectors.0.config.in=[1]"])) == {"c"}
    assert changed(base, digests(project, ["b.selectors.0.config.n=4"])) == {"b", "c"}
    assert changed(base, digests(project, ["a.selectors.0.config.strip=false"])) == {"a", "b", "c", "d"}
    # An explicit default is the same config as an omitted one.
    assert digests(project, ["a.selectors.0.config.strip=true"]) == base
    assert changed(base, digests(project, ["seed=4"])) == {"a", "b", "c", "d"}
    assert changed(base, digests(project, ["b.settings.seed=9"])) == {"b", "c"}


def test_input_content_and_data_version_enter_the_digest(tmp_path, make_project):
    project = make_project(tmp_path)
    base = digests(project)
    with (project / "in.jsonl").open("a") as f:
        f.write('{"prompt": "9+9", "level": 1}\n')
    grown = digests(project)
    assert changed(base, grown) == {"a", "b", "c", "d"}
    (project / "data.dvc").write_text("outs:\n- md5: 0123abcd.dir\n  path: data\n")
    assert changed(grown, digests(project)) == {"a", "b", "c", "d"}


def test_hash_cache_skips_unchanged_files_and_rereads_changed_ones(tmp_path, monkeypatch):
    from alignflow.flows import digest as dg

    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"a" * 1000)
    (folder / "sub" / "b.bin").write_bytes(b"b" * 10)
    old = time.time() - 60  # older than the racy window: remembered
    for p in (folder / "a.bin", folder / "sub" / "b.bin"):
        os.utime(p, (old, old))
    plain = dg.hash_path(folder)
    reads = []
    real = dg.hash_file
    monkeypatch.setattr(dg, "hash_file", lambda p: reads.append(p.name) or real(p))
    cache = dg.HashCache(tmp_path / "state" / "hashes.sqlite")
    assert dg.hash_path(folder, cache) == plain and sorted(reads) == ["a.bin", "b.bin"]
    cache.close()
    reads.clear()
    cache = dg.HashCache(tmp_path / "state" / "hashes.sqlite")  # a later run: a new connection
    assert dg.hash_path(folder, cache) == plain and reads == []
    # Same size, new content and mtime: re-read, and the folder's hash changes.
    (folder / "a.bin").write_bytes(b"c" * 1000)
    os.utime(folder / "a.bin", (old + 1, old + 1))
    changed = dg.hash_path(folder, cache)
    assert reads == ["a.bin"] and changed != plain and changed == dg.hash_path(folder)
    # A file modified just now is hashed every time (it could change again within the same mtime tick).
    (folder / "sub" / "b.bin").write_bytes(b"d" * 10)
    reads.clear()
    dg.hash_path(folder, cache), dg.hash_path(folder, cache)
    assert reads.count("b.bin") == 2


def test_hash_cache_in_an_unwritable_place_only_costs_speed(tmp_path):
    from alignflow.flows import digest as dg

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "1+1"}\n')
    cache = dg.HashCache(blocker / "hashes.sqlite")
    assert dg.hash_path(f, cache) == dg.hash_file(f)


def test_planning_remembers_input_hashes_in_the_project(tmp_path, make_project):
    project = make_project(tmp_path)
    old = time.time() - 60
    os.utime(project / "in.jsonl", (old, old))
    first = digests(project)
    db = project / ".alignflow" / "hashes.sqlite"
    with sqlite3.connect(db) as conn:
        paths = [r[0] for r in conn.execute("SELECT path FROM hashes")]
    assert str((project / "in.jsonl").resolve()) in paths
    assert digests(project) == first


def test_code_hash_follows_what_a_runner_imports_and_nothing_else(tmp_path, monkeypatch):
    import importlib

    from alignflow.flows.digest import code_hash

    pkg = tmp_path / "hashpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def shared():\n    return 1\n")
    (pkg / "other.py").write_text("def unrelated():\n    return 2\n")
    (pkg / "runner.py").write_text("from hashpkg.helper import shared\n\ndef run():\n    return shared()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("hashpkg.runner")
    importlib.import_module("hashpkg.other")  # imported, so an attribute of the package, but not used
    before = code_hash("hashpkg.runner", package="hashpkg.")
    (pkg / "other.py").write_text("def unrelated():\n    return 3\n")
    assert code_hash("hashpkg.runner", package="hashpkg.") == before
    (pkg / "helper.py").write_text("def shared():\n    return 4\n")  # the runner's numbers would change
    assert code_hash("hashpkg.runner", package="hashpkg.") != before
    for name in ("hashpkg.runner", "hashpkg.helper", "hashpkg.other", "hashpkg"):
        monkeypatch.delitem(sys.modules, name)


def test_a_plugin_digest_covers_the_helper_modules_of_its_own_package(tmp_path, monkeypatch):
    """A plugin class subclassing a class in another module of its package reruns when that module changes."""
    import importlib

    from alignflow.flows.digest import plugin_code

    pkg = tmp_path / "thirdparty_algo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("import torch\n\nclass Base:\n    scale = 1.0\n")
    (pkg / "other.py").write_text("X = 1\n")
    (pkg / "plugin.py").write_text("from thirdparty_algo.base import Base\n\nclass Algo(Base):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = importlib.import_module("thirdparty_algo.plugin").Algo
    importlib.import_module("thirdparty_algo.other")
    before = plugin_code(algo, "thirdparty-algo")
    assert before["imports"]["torch"] == importlib.metadata.version("torch")  # another distribution: its version
    (pkg / "other.py").write_text("X = 2\n")
    assert plugin_code(algo, "thirdparty-algo") == before
    (pkg / "base.py").write_text("import torch\n\nclass Base:\n    scale = 2.0\n")
    assert plugin_code(algo, "thirdparty-algo")["source"] != before["source"]
    for name in ("thirdparty_algo.plugin", "thirdparty_algo.base", "thirdparty_algo.other", "thirdparty_algo"):
        monkeypatch.delitem(sys.modules, name)


def test_the_number_of_processes_enters_the_digest_of_rl_stages_only(tmp_path, monkeypatch):
    """An rl stage's ranks sample with their own seeds, so two processes make other rollouts than one;
    an sft stage lands on the same weights whatever the number."""
    from alignflow.flows.options import RunOptions

    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2", "answer": "2"}\n')
    spec = parse_spec({"name": "p", "stages": {
        "sft": {"kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": "rows.jsonl"}, "algorithm": "sft"},
        "rl": {"kind": "rl", "inputs": {"model": "stage:sft", "dataset": "rows.jsonl"}, "algorithm": "grpo",
               "rewards": ["math_accuracy"], "sampler": "hf"}}})

    def plan(options=RunOptions()):
        return {n: p.digest for n, p in plan_pipeline(spec, tmp_path, get_plugins(), options).items()}

    one = plan()
    assert plan(RunOptions(nproc=1)) == one
    assert changed(one, plan(RunOptions(nproc=2))) == {"rl"}


def test_code_hash_follows_imports_made_inside_functions(tmp_path, monkeypatch):
    """A plugin that imports a helper lazily (inside a method, to keep import time low) still reruns when
    the helper changes: the source's imports count wherever they are made; a name imported from a module
    that is not itself a module, and a module never imported, are handled."""
    import importlib

    from alignflow.flows.digest import code_hash

    pkg = tmp_path / "lazypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def shared():\n    return 1\n")
    (pkg / "sub.py").write_text("X = 1\n")
    (pkg / "runner.py").write_text("def run():\n    from lazypkg.helper import shared\n    from . import sub\n"
                                   "    return shared() + sub.X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("lazypkg.runner")  # neither helper nor sub is imported yet
    before = code_hash("lazypkg.runner", package="lazypkg.")
    (pkg / "helper.py").write_text("def shared():\n    return 4\n")
    after_helper = code_hash("lazypkg.runner", package="lazypkg.")
    (pkg / "sub.py").write_text("X = 2\n")  # reached by a relative import
    assert len({before, after_helper, code_hash("lazypkg.runner", package="lazypkg.")}) == 3
    for name in ("lazypkg.runner", "lazypkg.helper", "lazypkg.sub", "lazypkg"):
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)


def test_a_runner_digest_reaches_its_helpers_and_not_the_other_runners():
    """Every runner imports the runner contract (alignflow.flows.stages); the kind -> runner table that
    imports every runner lives apart from it, so an edit to the rl stage does not rerun an sft stage."""
    import alignflow.flows.stages.sft  # noqa: F401
    from alignflow.flows.digest import _closure

    reached = _closure("alignflow.flows.stages.sft", lambda dep: dep.startswith("alignflow."))
    assert {"alignflow.flows.stages.training", "alignflow.core.train.models"} <= reached
    assert not reached & {"alignflow.flows.stages.rl.stage", "alignflow.flows.stages.critique",
                          "alignflow.flows.stages.runners"}


def test_a_docstring_comment_or_layout_change_keeps_the_source_hash_and_code_changes_it(tmp_path):
    from alignflow.flows.digest import source_hash

    def h(name, text):
        path = tmp_path / name
        path.write_text(text)
        return source_hash(path)

    base = h("a.py", '"""Module."""\n\ndef f(x):\n    """Twice x."""\n    return 2 * x  # double\n')
    assert h("b.py", '"""Another docstring."""\ndef f(x):\n    return 2*x\n') == base
    assert h("c.py", 'def f(x):\n    """Only the doc."""\n') != base  # a body that is only a docstring
    assert h("d.py", '"""Module."""\n\ndef f(x):\n    return 3 * x\n') != base
    assert h("e.py", 'def f(x):\n    return "2 * x"\n') != base  # a string that is not a docstring counts
    assert h("data.txt", "bytes") == h("data2.txt", "bytes") != h("data3.txt", "other")


def test_compute_library_versions_enter_the_digest_and_the_hardware_does_not(tmp_path, make_project, monkeypatch):
    import torch

    from alignflow.core import fingerprint as fp

    project = make_project(tmp_path)
    base = digests(project)
    real = fp.distribution_version
    monkeypatch.setattr(fp, "distribution_version", lambda d: "0.0.1-fake" if d == "transformers" else real(d))
    assert changed(base, digests(project)) == {"a", "b", "c", "d"}
    monkeypatch.setattr(fp, "distribution_version", real)
    fp.cpu.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "FAKE512")
    try:
        assert fp.fingerprint()["cpu_capability"] == "FAKE512"
        assert digests(project) == base
    finally:
        fp.cpu.cache_clear()


def test_operational_config_fields_stay_out_of_the_digest(tmp_path):
    """A remote scorer moved to another host, given more time or more connections, reruns nothing; a new
    declared version (or model) of the scorer reruns the stage that scored with it."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2", "answer": "2"}\n')

    def plan(**remote):
        config = {"url": "http://rm-a:8000/score", "model": "rm", "version": "1", **remote}
        spec = parse_spec({"name": "p", "stages": {
            "eval": {"kind": "evaluate", "inputs": {"model": "builtin:tiny", "dataset": "rows.jsonl"},
                     "rewards": [{"name": "remote", "config": config}]}}})
        return plan_pipeline(spec, tmp_path, get_plugins())["eval"]

    base = plan()
    assert "url" not in base.config["rewards"][0]["config"]  # nor in the manifest or MLflow's params
    moved = plan(url="https://rm-b.example:443/v2/score", timeout_s=5, retries=9, max_concurrency=64,
                 headers={"X-Team": "rl"}, api_key_env="RM_KEY", batch_size=4)
    assert moved.digest == base.digest
    assert plan(version="2").digest != base.digest
    assert plan(model="rm-large").digest != base.digest


def test_digest_dump_drops_operational_fields_at_any_depth():
    from pydantic import BaseModel

    from alignflow.core.contracts import digest_dump, operational

    class Inner(BaseModel):
        host: str = operational("a")
        size: int = 1

    class Outer(BaseModel):
        inner: Inner = Inner()
        many: list[Inner] = [Inner(), Inner(size=2)]
        named: dict[str, Inner] = {"x": Inner()}
        port: int = operational(80)

    assert digest_dump(Outer()) == {"inner": {"size": 1}, "many": [{"size": 1}, {"size": 2}],
                                    "named": {"x": {"size": 1}}}
    assert digest_dump(Inner(host="b")) == digest_dump(Inner()) != digest_dump(Inner(size=3))
