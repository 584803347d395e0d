"""`--set` on a pipeline's raw YAML: it reaches the named stage only, also where stages share a YAML alias."""

import yaml

from alignflow.flows.overrides import apply_overrides

SHARED = yaml.safe_load("""
stages:
  a: {kind: preference, settings: &train {lr: 1.0e-4, epochs: 1}}
  b: {kind: preference, settings: *train}
""")


def test_a_set_on_one_stage_leaves_a_stage_that_shares_its_yaml_alias_as_written():
    assert SHARED["stages"]["a"]["settings"] is SHARED["stages"]["b"]["settings"]  # one object, as loaded
    raw = apply_overrides(SHARED, ["a.settings.epochs=3"])
    assert raw["stages"]["a"]["settings"] == {"lr": 1.0e-4, "epochs": 3}
    assert raw["stages"]["b"]["settings"] == {"lr": 1.0e-4, "epochs": 1}
    assert SHARED["stages"]["a"]["settings"]["epochs"] == 1  # the caller's dict is untouched
    assert list(raw["stages"]) == ["a", "b"]  # in the file's order
