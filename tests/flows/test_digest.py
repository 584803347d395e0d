from alignflow.core.plugins import get_plugins
from alignflow.core.spec import parse_spec
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
