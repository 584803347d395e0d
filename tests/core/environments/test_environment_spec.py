"""An `environment:` in a pipeline: where it is allowed, what it replaces, what validate says, what the digest holds."""

import pytest
import yaml

from alignflow.core import SpecError
from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import parse_spec, resolved_stages
from alignflow.flows.digest import plugin_versions, stage_config

SPEC = """
name: tools
stages:
  rl:
    kind: rl
    inputs: {model: builtin:tiny, dataset: rl.jsonl}
    algorithm: grpo
    environment: {name: math_tools, config: {tools: [calculator, python]}, max_turns: 3}
  test:
    kind: evaluate
    inputs: {model: "stage:rl", dataset: test.jsonl}
    environment: math_tools
"""


def parse(text=SPEC, **edit):
    raw = yaml.safe_load(text)
    for path, value in edit.items():
        stage, field = path.split("__")
        raw["stages"][stage][field] = value
    return parse_spec(raw, "tools.yaml", get_plugins())


def test_an_environment_stands_in_for_rewards_and_brings_the_default_sampler():
    spec = parse()
    rl = spec.stages["rl"]
    assert rl.environment.max_turns == 3 and rl.environment.tool_format == "auto" and rl.rewards == []
    assert rl.sampler.name == "hf" and spec.stages["test"].sampler.name == "hf"


def test_unknown_environment_and_bad_config_are_named_before_any_compute():
    with pytest.raises(SpecError) as info:
        parse(rl__environment={"name": "math_tool"}, test__environment={"name": "math_tools",
                                                                         "config": {"tools": ["abacus"]}})
    msg = str(info.value)
    assert "stage 'rl', environment.name" in msg and "math_tools" in msg  # the closest name is suggested
    assert "stage 'test', environment.config.tools.0" in msg


def test_limits_are_checked_and_kinds_without_episodes_refuse_one():
    with pytest.raises(SpecError, match="environment.max_turns"):
        parse(rl__environment={"name": "math_tools", "max_turns": 0})
    raw = yaml.safe_load(SPEC)
    raw["stages"]["sft"] = {"kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": "sft.jsonl"},
                            "algorithm": "sft", "environment": "math_tools"}
    with pytest.raises(SpecError, match="stage 'sft', environment: a 'sft' stage takes no environment"):
        parse_spec(raw, "tools.yaml", get_plugins())


def test_rl_without_rewards_or_environment_is_refused():
    with pytest.raises(SpecError, match="needs at least one reward \\(or an environment\\)"):
        parse(rl__environment=None)


def test_the_digest_holds_the_environment_its_limits_and_its_code_and_stages_without_one_are_unchanged():
    spec, plugins = parse(), get_plugins()
    config = stage_config(spec.stages["rl"], resolved_stages(spec, plugins)["rl"])
    assert config["environment"] == {"name": "math_tools", "config": {"tools": ["calculator", "python"]},
                                     "max_turns": 3, "max_tokens": None, "tool_format": "auto", "weight": 1.0}
    versions = plugin_versions(spec.stages["rl"], plugins)
    assert versions["environment/math_tools"]["distribution"] == "alignflow"
    assert len(versions["environment/math_tools"]["source"]) == 64  # a hash of the code it imports
    plain = parse(rl__environment=None, rl__rewards=["math_accuracy"])
    # earlier digests stay valid
    assert "environment" not in stage_config(plain.stages["rl"], resolved_stages(plain, plugins)["rl"])


TIME = {"command": ["mcp-server-time", "--local-timezone", "UTC"], "tools": ["convert_time"]}


def test_mcp_servers_are_checked_as_the_spec_is_read():
    for server, says in [({"url": "http://10.0.0.5:8000/mcp"}, "must listen on this machine's loopback"),
                         ({**TIME, "url": "http://127.0.0.1:8000/mcp"}, "exactly one of `command`"),
                         ({"url": "http://[::1]:8000/mcp", "cwd": "/tmp"}, "`env` and `cwd` are for a `command`"),
                         ({"command": []}, "`command` is empty"), ({**TIME, "timeout_s": 0}, "timeout_s")]:
        with pytest.raises(SpecError, match="stages.rl.environment.mcp.0") as info:
            parse(rl__environment={"name": "math_tools", "mcp": [server]})
        assert says in str(info.value)
    spec = parse(rl__environment={"name": "math_tools", "mcp": [{"url": "http://localhost:8000/mcp"}]})
    assert spec.stages["rl"].environment.mcp[0].label == "http://localhost:8000/mcp"
    agent = {"name": "openai_agent", "config": {"command": ["my-agent"]}, "mcp": [TIME]}
    with pytest.raises(SpecError, match=r"stage 'rl', environment.mcp: 'openai_agent' drives its own episodes"):
        parse(rl__environment=agent)


def test_the_digest_holds_each_mcp_server_and_the_tools_it_keeps():
    plugins = get_plugins()

    def env_config(*servers):
        spec = parse(rl__environment={"name": "math_tools", "mcp": list(servers)})
        return stage_config(spec.stages["rl"], resolved_stages(spec, plugins)["rl"])["environment"]

    config = env_config(TIME)
    assert config["mcp"] == [{**TIME, "env": {}, "cwd": None, "url": None, "timeout_s": 30.0}]
    others = [env_config({**TIME, "tools": None}), env_config({**TIME, "command": ["mcp-server-time"]}),
              env_config({**TIME, "timeout_s": 5}), env_config(TIME, {"url": "http://127.0.0.1:8000/mcp"})]
    assert all(other != config for other in others)
    assert env_config({**TIME, "start_timeout_s": 5}) == config  # how long a start may take changes no result
    without = parse()
    # earlier digests stay
    assert "mcp" not in stage_config(without.stages["rl"], resolved_stages(without, plugins)["rl"])["environment"]


def test_a_stage_s_episodes_carry_its_mcp_servers(tmp_path):
    from alignflow.flows.stages.scoring import episodes_of
    from helpers.stages import stage_context

    spec = parse(rl__environment={"name": "math_tools", "mcp": [TIME]})
    ctx = stage_context(tmp_path, spec, "rl", settings=resolved_stages(spec, get_plugins())["rl"].settings)
    episodes = episodes_of(ctx)
    assert [s.command for s in episodes.mcp] == [TIME["command"]] and episodes.mcp[0].tools == ["convert_time"]


def test_a_task_librarys_version_enters_the_digest_of_a_stage_that_uses_it():
    spec = parse(rl__rewards=["reasoning_gym"])
    versions = plugin_versions(spec.stages["rl"], get_plugins())
    assert versions["reward/reasoning_gym"]["libraries"] == {"reasoning-gym": "0.1.25"}
